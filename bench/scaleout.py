"""What adapter-aware routing buys: 3 replicas, 48 LoRAs over small device budgets, three routers in one run.

    .venv/bin/python bench/scaleout.py                        # SmolLM2 GGUF, 3 replicas, 48 adapters (~6 min)
    .venv/bin/python bench/scaleout.py --requests 48 --rounds 1

Three ``loraplex serve`` processes of the default model (``--gguf ... --weights auto``, one torch thread each) share
48 random PEFT LoRAs (rank 8 on q/v; ``bench/loadgen.py``'s writer) registered lazily; each replica's device tier
holds only ``--device-adapters`` of them, so an adapter sent to a replica that does not hold it costs a load (and
an eviction). A client sends ``--requests`` greedy requests (``--new-tokens`` each, EOS ignored), their adapters
drawn from a Zipf-like popularity over the 48 (seeded, the same sequence for every router), ``--concurrency`` in
flight, through one of three routers:
  * ``round-robin``: replica ``i mod 3`` (what a plain Kubernetes Service or client-side round_robin gives);
  * ``hash``: a stable hash of the adapter id (what ``deploy/nginx``'s affinity template does);
  * ``least-loaded-with-adapter``: among replicas that served the adapter recently (a per-replica LRU the size of
    its device tier), the one with the fewest requests in flight, unless it is full (``--max-batch-size``); else
    the least loaded replica (the endpoint picker's LoRA-affinity + queue scorers, as the client sees them).
Routers alternate per round (order rotated); figures are medians over ``--rounds``: output tok/s, TTFT p50/p99,
and device-tier misses (loads) read from each replica's own ``/metrics``. Writes bench/results/scaleout.json.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import grpc
import loadgen
import serve as bench_serve
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench/.work/scaleout"
GGUF = ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"
Router = Callable[[str, list[int]], int]


class Replica:
    def __init__(self, index: int, adapters: Path, budget: int, args: argparse.Namespace) -> None:
        port, self.metrics_port = 50860 + 2 * index, 50861 + 2 * index
        self.target = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(loadgen.SMOLLM2), "--port", str(port)]
        cmd += ["--gguf", str(GGUF), "--weights", "auto", "--threads", "1", "--no-adaptive-threads"]
        cmd += ["--metrics-port", str(self.metrics_port), "--http-port", "-1", "--adapter-dir", str(adapters)]
        cmd += ["--max-batch-size", str(args.max_batch_size), "--adapter-device-budget-bytes", str(budget)]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'clients/python'}"}
        log = (WORK / f"replica-{index}.log").open("w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait(self) -> None:
        bench_serve.wait_serving(self.target, time.monotonic(), timeout=300, proc=self.proc)

    def device_misses(self) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "loraplex_adapter_cache_events_total" and s.labels == {"event": "miss", "tier": "device"}:
                    return s.value
        return 0.0


def round_robin() -> Router:
    counter = iter(range(1 << 62))
    return lambda adapter, in_flight: next(counter) % len(in_flight)


def hashed() -> Router:
    return lambda adapter, in_flight: int(hashlib.sha256(adapter.encode()).hexdigest(), 16) % len(in_flight)


def least_loaded_with_adapter(capacity: int, max_batch: int) -> Router:
    recent: list[OrderedDict[str, None]] = []

    def route(adapter: str, in_flight: list[int]) -> int:
        while len(recent) < len(in_flight):
            recent.append(OrderedDict())
        holders = [i for i, lru in enumerate(recent) if adapter in lru and in_flight[i] < max_batch]
        pick = min(holders or range(len(in_flight)), key=lambda i: in_flight[i])
        lru = recent[pick]
        lru[adapter] = None
        lru.move_to_end(adapter)
        while len(lru) > capacity:
            lru.popitem(last=False)
        return pick

    return route


async def one_round(
    replicas: list[Replica], route: Router, plan: list[str], args: argparse.Namespace
) -> dict[str, float]:
    in_flight = [0] * len(replicas)
    ttft: list[float] = []
    tokens = 0
    sem = asyncio.Semaphore(args.concurrency)
    channels = [grpc.aio.insecure_channel(r.target) for r in replicas]
    stubs = [pb_grpc.GenerationStub(c) for c in channels]
    misses_before = sum(r.device_misses() for r in replicas)

    async def one(i: int, adapter: str) -> None:
        nonlocal tokens
        async with sem:
            pick = route(adapter, in_flight)
            in_flight[pick] += 1
            req = bench_serve.stream_request(i, args.new_tokens, adapter)
            sent = time.perf_counter()
            try:
                async for msg in stubs[pick].GenerateStream(req):
                    if msg.token_ids:
                        tokens += len(msg.token_ids)
                        if sent > 0:  # the first token
                            ttft.append(time.perf_counter() - sent)
                            sent = 0.0
            finally:
                in_flight[pick] -= 1

    start = time.perf_counter()
    await asyncio.gather(*(one(i, a) for i, a in enumerate(plan)))
    wall = time.perf_counter() - start
    for c in channels:
        await c.close()
    misses = sum(r.device_misses() for r in replicas) - misses_before
    return {
        "tok_s": tokens / wall,
        "ttft_p50": bench_serve.pct(ttft, 0.5),
        "ttft_p99": bench_serve.pct(ttft, 0.99),
        "device_misses": misses,
    }


def workload(ids: list[str], n: int, seed: int) -> list[str]:
    """``n`` adapter ids drawn with popularity 1/rank (Zipf, s=1) over ``ids``."""
    rng = random.Random(seed)
    return rng.choices(ids, weights=[1 / (k + 1) for k in range(len(ids))], k=n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=48)
    parser.add_argument("--device-adapters", type=int, default=6, help="adapters each replica's device tier holds")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/scaleout.json")
    args = parser.parse_args()
    started, load_before = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()
    WORK.mkdir(parents=True, exist_ok=True)
    ids, nbytes = loadgen.write_adapters(loadgen.SMOLLM2, WORK / "adapters", args.adapters, 8, ["q_proj", "v_proj"])
    budget = args.device_adapters * nbytes // 2  # the tier holds them in bf16 (the model's dtype here): half of fp32
    replicas = [Replica(i, WORK / "adapters", budget, args) for i in range(args.replicas)]
    routers: dict[str, Callable[[], Router]] = {
        "round-robin": round_robin,
        "hash": hashed,
        "least-loaded-with-adapter": lambda: least_loaded_with_adapter(args.device_adapters, args.max_batch_size),
    }
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in routers}
    try:
        for r in replicas:
            r.wait()
        names = list(routers)
        for rnd in range(args.rounds):
            plan = workload(ids, args.requests, seed=rnd)
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                got = asyncio.run(one_round(replicas, routers[name](), plan, args))
                rows[name].append(got)
                print(f"round {rnd} {name:26} " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    finally:
        for r in replicas:
            bench_serve.stop_server(r.proc)
    summary = {name: {k: statistics.median(x[k] for x in got) for k in got[0]} for name, got in rows.items()}
    for name, s in summary.items():
        print(
            f"{name:26} tok/s {s['tok_s']:7.1f}  TTFT p50 {s['ttft_p50']:.3f} s  p99 {s['ttft_p99']:.3f} s  "
            f"device misses {s['device_misses']:.0f}"
        )
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "rounds": rows}
    result.update(bench_serve.run_record("bench/scaleout.py", started, load_before))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
