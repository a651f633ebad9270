"""Cold-start curve: TTFT and throughput with N active adapters over a device tier that holds ``--slots`` of them.

    .venv/bin/python bench/adapters_coldstart.py            # full curve (N = 8, 32, 128, 512; zipf + uniform)
    .venv/bin/python bench/adapters_coldstart.py --quick    # CI smoke: tiny counts, checks the report's shape

Work: SmolLM2-135M-Instruct fp32 served over loopback gRPC (``bench/serve.py``'s ``OurServer``), PEFT LoRA r=8 on
q_proj,v_proj. N adapter ids are N folders under bench/.work/coldstart/nN, each a copy of the config and a hard link
to one of 32 distinct weight files written by ``bench/adapters.py`` (id i -> file i mod 32): every id is a separate
registration, load and device copy; only the page cache is shared. Closed loop: ``--concurrency`` clients, each
sending its next request when the last ends, adapters drawn from Zipf (s = ``--zipf-s``, rank 1 most popular) or
uniform popularity, seeded per round. Per N and popularity, two servers run side by side, rounds alternating:
``tight`` (``--adapter-device-budget-bytes`` = exactly ``--slots`` adapters' device bytes) and ``resident`` (a
budget holding all N; ``--overflow`` sets both servers' ``--adapter-overflow-adapters``, the adapters the tight one
may lay out past its budget while all of its slots are in use). One warm-up round each, then ``--runs`` measured
rounds; reported: client TTFT p50/p99 and output tok/s (medians over rounds), tight/resident ratios per round pair
(medians), and the loads, evictions and disk reads of each round (ListAdapters before/after, summed over adapters).
Results: bench/results/adapters_coldstart.json; the table in bench/README.md ("Cold-start curve").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import machine as bench_machine
import torch
from loraplex.v1 import adapters_pb2 as apb
from loraplex.v1 import adapters_pb2_grpc as apb_grpc
from loraplex.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from serve import OurServer, pct, stream_request, summary  # noqa: E402

from adapters import WORK, write_adapters  # noqa: E402

DISTINCT_FILES = 32


def id_folders(source: Path, names: list[str], n: int) -> Path:
    """``n`` adapter folders (config copied, weights hard-linked, id i -> source file i mod len(names))."""
    root = WORK / "coldstart" / f"n{n}"
    if root.exists() and len(list(root.iterdir())) == n:
        return root
    shutil.rmtree(root, ignore_errors=True)
    for i in range(n):
        d, src = root / f"c{i:04d}", source / names[i % len(names)]
        d.mkdir(parents=True)
        shutil.copy(src / "adapter_config.json", d)
        os.link(src / "adapter_model.safetensors", d / "adapter_model.safetensors")
    return root


def device_nbytes(model: Path, folder: Path) -> int:
    """One adapter's device-tier bytes in fp32, as the store budgets them."""
    from service.adapters.lora.reader import DEVICE_ALIGN
    from service.adapters.lora.registry import index_adapter
    from service.adapters.lora.spec import plan_nbytes
    from service.model.config import ModelConfig

    spec = index_adapter("probe", folder, ModelConfig.from_hf(model), roots=(folder.parent,))
    return plan_nbytes(spec, torch.float32, DEVICE_ALIGN)


def picks(n: int, popularity: str, count: int, seed: int, s: float) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** s for k in range(n)] if popularity == "zipf" else [1.0] * n
    return rng.choices(range(n), weights=weights, k=count)


def counters(target: str) -> dict[str, int]:
    with grpc.insecure_channel(target) as ch:
        listed = apb_grpc.AdaptersStub(ch).ListAdapters(apb.ListAdaptersRequest(), timeout=60).adapters
    return {
        "loads": sum(a.loads for a in listed),
        "evictions": sum(a.evictions for a in listed),
        "disk_reads": sum(a.disk_reads for a in listed),
        "on_device": sum(a.tier == apb.ADAPTER_TIER_DEVICE for a in listed),
    }


async def closed_loop(target: str, ids: list[str], concurrency: int, new_tokens: int) -> dict[str, Any]:
    """Every id in ``ids`` once, ``concurrency`` clients in a closed loop; TTFT per request and output tok/s."""
    queue = list(reversed(ids))
    ttft: list[float] = []
    tokens = 0
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def client(c: int) -> None:
            nonlocal tokens
            while queue:
                i = len(queue)
                req = stream_request(i + c, new_tokens, queue.pop())
                sent = time.perf_counter()
                first = True
                async for msg in stub.GenerateStream(req):
                    if first:
                        ttft.append(time.perf_counter() - sent)
                        first = False
                    tokens += len(msg.token_ids)

        start = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(concurrency)))
        wall = time.perf_counter() - start
    return {"ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "tok_s": tokens / wall, "n": len(ttft)}


def one_point(args: argparse.Namespace, n: int, popularity: str, folder: Path, unit: int) -> dict[str, Any]:
    """One (N, popularity) point: tight and resident servers side by side, rounds alternating."""
    ids = sorted(p.name for p in folder.iterdir())
    budgets = {"tight": args.slots * unit, "resident": max(n, args.slots) * unit}
    extra = ["--adapter-dir", str(folder), "--adapter-host-budget-bytes", str(args.host_budget)]
    if args.overflow is not None:
        extra += ["--adapter-overflow-adapters", str(args.overflow)]
    servers = {
        mode: OurServer(args.model, "float32", args.port + k, args.concurrency,
                        extra=[*extra, "--adapter-device-budget-bytes", str(b)])
        for k, (mode, b) in enumerate(budgets.items())
    }  # fmt: skip
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in servers}
    try:
        for r in range(args.runs + 1):  # round 0 warms up
            drawn = [ids[i] for i in picks(n, popularity, args.requests, seed=1000 * n + r, s=args.zipf_s)]
            for mode, srv in servers.items():
                target = f"127.0.0.1:{srv.port}"
                before = counters(target)
                got = asyncio.run(closed_loop(target, drawn, args.concurrency, args.new_tokens))
                after = counters(target)
                got |= {k: after[k] - before[k] for k in ("loads", "evictions", "disk_reads")}
                if r:
                    rounds[mode].append(got)
                print(f"N={n} {popularity} {mode} round {r}: TTFT p50 {got['ttft_p50'] * 1e3:.0f} ms p99 "
                      f"{got['ttft_p99'] * 1e3:.0f} ms, {got['tok_s']:.1f} tok/s, loads {got['loads']} "
                      f"evictions {got['evictions']} disk reads {got['disk_reads']}", flush=True)  # fmt: skip
    finally:
        for srv in servers.values():
            srv.stop()
    out: dict[str, Any] = {"budget_bytes": budgets}
    for mode, rs in rounds.items():
        out[mode] = {k: summary([x[k] for x in rs]) for k in ("ttft_p50", "ttft_p99", "tok_s", "loads",
                                                              "evictions", "disk_reads")}  # fmt: skip
    pairs = list(zip(rounds["tight"], rounds["resident"], strict=True))
    out["ratio"] = {k: summary([t[k] / r[k] for t, r in pairs if r[k] > 0]) for k in ("ttft_p50", "ttft_p99", "tok_s")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models/SmolLM2-135M-Instruct")
    parser.add_argument("--active", default="8,32,128,512", help="N: active adapters per point")
    parser.add_argument("--popularity", default="zipf,uniform")
    parser.add_argument("--slots", type=int, default=8, help="adapters the tight device budget holds")
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256, help="requests per round")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--host-budget", type=int, default=2 << 30, help="--adapter-host-budget-bytes, both servers")
    parser.add_argument("--port", type=int, default=50830)
    parser.add_argument(
        "--overflow", type=int, help="--adapter-overflow-adapters, both servers (default: the server's)"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/adapters_coldstart.json")
    args = parser.parse_args()
    if args.quick:
        args.active, args.popularity, args.slots, args.concurrency = "2,6", "zipf", 2, 4
        args.requests, args.new_tokens, args.runs = 8, 2, 1
    active = [int(x) for x in args.active.split(",")]
    names = write_adapters(args.model, WORK / "adapters", 2 if args.quick else DISTINCT_FILES)
    unit = device_nbytes(args.model, WORK / "adapters" / names[0])
    results: dict[str, Any] = {
        "command": " ".join(["bench/adapters_coldstart.py", *sys.argv[1:]]),
        "machine": bench_machine.describe(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_avg_before": os.getloadavg(),
        "model": args.model.name,
        "adapter_device_bytes": unit,
        "distinct_weight_files": len(names),
        **{
            k: getattr(args, k)
            for k in ("slots", "zipf_s", "concurrency", "requests", "new_tokens", "runs", "overflow")
        },
        "points": {},
    }
    for n in active:
        folder = id_folders(WORK / "adapters", names, n)
        for popularity in args.popularity.split(","):
            results["points"][f"{n}/{popularity}"] = one_point(args, n, popularity, folder, unit)
    results["load_avg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"wrote {args.out}")
    if args.quick:  # it ran and produced sane numbers (never a duration bound)
        assert all(p["tight"]["tok_s"]["median"] > 0 for p in results["points"].values())


def print_table(results: dict[str, Any]) -> None:
    print("\n| N / popularity | TTFT p99 tight / resident (ms) | p99 ratio | tok/s ratio | loads, evictions, disk "
          "reads per round (tight) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for key, p in results["points"].items():
        t, r, q = p["tight"], p["resident"], p["ratio"]
        print(f"| {key} | {t['ttft_p99']['median'] * 1e3:.0f} / {r['ttft_p99']['median'] * 1e3:.0f} | "
              f"{q['ttft_p99']['median']:.2f} | {q['tok_s']['median']:.2f} | {t['loads']['median']:.0f}, "
              f"{t['evictions']['median']:.0f}, {t['disk_reads']['median']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
