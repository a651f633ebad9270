"""Memory under adapter churn: ``bench/loadgen.py``'s soak in the reliability probe's shape, judged by its RSS slope.

    .venv/bin/python bench/soak.py --json bench/results/soak.json    # 10 min, the figure in bench/README.md
    .venv/bin/python bench/soak.py --seconds 120 --tiny              # a quick look

A thin entry over ``loadgen``: the same server, traffic, churn, probes and checks, with these defaults: 13 PEFT LoRAs
(rank 2 on ``q_proj,v_proj``, 0.46 MB each in fp32) under a 1 MiB adapter device budget (room for two: every
other request loads or lays one out), 8 clients over 4 running + 2 queued rows, one adapter unloaded and
registered again every 15 s, 600 s. Before the clock starts, every prompt is sent once to the base model and once
to each adapter (``warm_pairs``): that fills the prefix cache with its working set and loads every adapter once,
so what the slope measures is what keeps growing, not a cache filling its budget. The report adds
``rss_slope_after_warmup_mb_per_min`` (least squares over the samples after ``--warmup`` seconds: the last 8 of
10 minutes by default) to loadgen's; the run fails (exit 1) when it is ``--max-slope`` MB/min or more, or on any
of loadgen's checks. Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import torch
from loraplex.v1 import generation_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen

DEFAULTS = [
    "--soak", "600", "--adapters", "13", "--rank", "2", "--targets", "q_proj,v_proj", "--concurrency", "8",
    "--max-batch-size", "4", "--max-queue", "2", "--churn-every", "15", "--rss-every", "2",
]  # fmt: skip


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=None, help="soak length (default 600)")
    p.add_argument("--device-budget-bytes", type=int, default=1 << 20)
    p.add_argument("--warmup", type=float, default=120.0, help="seconds of the soak left out of the slope")
    p.add_argument("--max-slope", type=float, default=1.0, help="MB/min after the warm-up that fails the run")
    p.add_argument("--no-warm-pairs", action="store_true", help="start the clock without the warm pass")
    own, rest = p.parse_known_args(argv)
    extra = ["--soak", str(own.seconds)] if own.seconds is not None else []
    return own, loadgen.parse_args([*DEFAULTS, *extra, *rest])


async def warm_pairs(target: str, adapters: list[str], traffic_args: argparse.Namespace) -> int:
    """Every prompt once to the base model and once to each adapter, ``--concurrency`` at a time; the count."""
    traffic = loadgen.Traffic(target, adapters, traffic_args)
    pairs = [(prompt, adapter) for adapter in (None, *adapters) for prompt in loadgen.PROMPTS]
    room = asyncio.Semaphore(traffic_args.concurrency)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(pair: tuple[str, str | None]) -> None:
            async with room:
                await traffic.probe_answers(stub, [pair])  # retried while the queue is full

        await asyncio.gather(*(one(pair) for pair in pairs))
    return len(pairs)


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    return {
        "cpu": model or platform.processor(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    own, args = parse_args(argv)
    model, folder, adapters, each = loadgen.prepare(args)
    server = loadgen.Server(model, folder, args.port, args, own.device_budget_bytes)
    try:
        started = time.perf_counter()
        warmed = 0 if own.no_warm_pairs else asyncio.run(warm_pairs(server.target, adapters, args))
        warm_seconds = time.perf_counter() - started
        warm_rss = server.rss_mb()
        result = asyncio.run(loadgen.run(server, adapters, folder, args))
    finally:
        server.stop()
    after = [(t, mb) for t, mb in result["rss_series"] if t >= own.warmup]
    slope = loadgen.slope_mb_per_min(after)
    result.update(
        adapter_bytes=each,
        adapter_device_budget_bytes=own.device_budget_bytes,
        server_exit=server.proc.returncode,
        warm_pairs=warmed,
        warm_pairs_seconds=round(warm_seconds, 1),
        rss_after_warm_pairs_mb=round(warm_rss, 1),
        warmup_seconds=own.warmup,
        rss_after_warmup_start_mb=after[0][1] if after else float("nan"),
        rss_after_warmup_end_mb=after[-1][1] if after else float("nan"),
        rss_slope_after_warmup_mb_per_min=slope,
        machine=machine(),
        command=" ".join(["bench/soak.py", *(argv if argv is not None else sys.argv[1:])]),
    )
    if not slope < own.max_slope:
        result["problems"].append(f"RSS slope after {own.warmup:.0f} s: {slope:.2f} MB/min >= {own.max_slope}")
    loadgen.write_report(result, args.json)
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
