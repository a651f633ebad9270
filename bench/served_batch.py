"""Where a served batch's time and CPU go: bench/peers.py's batch (greedy, ``NEW_TOKENS`` new tokens a request, EOS
ignored) against one ``loraplex serve`` on loopback, streamed and unary in turn.

    .venv/bin/python bench/served_batch.py [--flags "--dtype bfloat16"] [--requests 32] [--runs 5] [--out FILE]

Per mode (``stream``: GenerateStream, one message a token, as bench/peers.py sends; ``unary``: Generate, one
response a request), the median tok/s over ``--runs`` measured batches (after one warm-up each; the modes in turn,
so the VM's drift hits both alike), and per batch, averaged over the runs:
  * the decode steps and the prefill passes (count and seconds), from the server's Prometheus metrics
    (``loraplex_batch_size`` counts decode steps; ``loraplex_prefill_pass_seconds``), scraped before and after;
  * CPU seconds by thread, read from /proc: the engine thread with its OpenMP workers (``lp-engine``: they inherit
    its OS name, service.torch_threads), the event loop (the main thread), the server's other threads, and this
    client process (its async gRPC client).
On a 2-vCPU machine, 2 x wall is all the CPU there is: what the event loop and the client take, the engine's
threads wait for (their parallel regions stop at a barrier while a core runs something else). Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import line
from peers_loraplex import ROOT, Server, free_port
from peers_workload import NEW_TOKENS, prompt
from prometheus_client.parser import text_string_to_metric_families

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
MODES = ("stream", "unary")
TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``pid``'s threads by group: engine (``lp-engine``), loop (the main thread),
    other (the rest); threads that ended are not counted."""
    out = {"engine": 0.0, "loop": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds = (int(fields[11]) + int(fields[12])) / TICKS
        group = "loop" if task.name == str(pid) else "engine" if comm == "lp-engine" else "other"
        out[group] += seconds
    return out


def scrape(port: int) -> dict[str, float]:
    """The counters this report needs from the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    wanted = {
        "loraplex_batch_size_count": "decode_steps",
        "loraplex_prefill_pass_seconds_count": "prefill_passes",
        "loraplex_prefill_pass_seconds_sum": "prefill_s",
    }
    found = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found[wanted[sample.name]] += sample.value
    return found


async def batch(target: str, mode: str, requests: int) -> float:
    """Wall seconds of ``requests`` requests sent at once in ``mode``, each checked for ``NEW_TOKENS`` tokens."""
    from loraplex import AsyncClient

    options: dict[str, Any] = {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0.0}
    async with AsyncClient(target) as client:
        await client.health()

        async def one(i: int) -> int:
            if mode == "unary":
                return len((await client.generate(prompt(i), return_token_ids=True, timeout=600, **options)).token_ids)
            n = 0
            async for delta in client.stream(prompt(i), return_token_ids=True, timeout=600, **options):
                n += len(delta.token_ids)
            return n

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - start
    if counts != [NEW_TOKENS] * requests:
        raise RuntimeError(f"{mode}: token counts {counts}, expected {NEW_TOKENS} each")
    return wall


def measure(server: Server, metrics_port: int, mode: str, requests: int) -> dict[str, float]:
    pid = server.proc.pid
    cpu0, met0, client0 = thread_cpu(pid), scrape(metrics_port), time.process_time()
    wall = asyncio.run(batch(server.target, mode, requests))
    cpu1, met1, client1 = thread_cpu(pid), scrape(metrics_port), time.process_time()
    out = {"wall_s": wall, "client_cpu_s": client1 - client0}
    out.update({f"{k}_cpu_s": cpu1[k] - cpu0[k] for k in cpu0})
    out.update({k: met1[k] - met0[k] for k in met0})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flags", default="--dtype bfloat16", help="extra `loraplex serve` flags")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the runs and the summary as JSON")
    args = p.parse_args()
    metrics_port = free_port()
    flags = [*shlex.split(args.flags), "--metrics-port", str(metrics_port)]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "served_batch-server.log"
    server = Server(MODEL, flags, None, free_port(), log)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    try:
        for mode in MODES:  # warm-ups
            measure(server, metrics_port, mode, args.requests)
        for _ in range(args.runs):
            for mode in MODES:
                runs[mode].append(measure(server, metrics_port, mode, args.requests))
    finally:
        server.stop()
    tokens = args.requests * NEW_TOKENS
    print(f"{line()}; server flags: {args.flags}; {args.requests} requests x {NEW_TOKENS} tokens; {args.runs} runs")
    print("| mode | tok/s (median) | wall s | decode steps | prefill passes | prefill s | CPU s: engine | loop | "
          "other server | client | CPU / (2 x wall) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    summary: dict[str, dict[str, float]] = {}
    for mode, rows in runs.items():
        mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
        rate = statistics.median(tokens / r["wall_s"] for r in rows)
        cpu = sum(mean[k] for k in ("engine_cpu_s", "loop_cpu_s", "other_cpu_s", "client_cpu_s"))
        summary[mode] = {"tok_s": rate, **mean, "cpu_share": cpu / (2 * mean["wall_s"])}
        print(f"| {mode} | {rate:.1f} | {mean['wall_s']:.3f} | {mean['decode_steps']:.1f} | "
              f"{mean['prefill_passes']:.1f} | {mean['prefill_s']:.3f} | {mean['engine_cpu_s']:.3f} | "
              f"{mean['loop_cpu_s']:.3f} | {mean['other_cpu_s']:.3f} | {mean['client_cpu_s']:.3f} | "
              f"{summary[mode]['cpu_share']:.2f} |")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"flags": args.flags, "runs": runs, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
