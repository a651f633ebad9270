"""GGUF served directly vs the converted folder: load time, peak RSS and batch-1 tok/s, same run.

    PYTHONPATH=.:clients/python .venv/bin/python bench/gguf_weights.py   # four servers, ~5 min on 2 quiet cores
    PYTHONPATH=.:clients/python .venv/bin/python bench/gguf_weights.py --rounds 1 --configs gguf-fp32 folder-fp32

Each configuration is a fresh ``loraplex serve`` subprocess (this checkout's code, ``python -m service.cli``) on
loopback: ``folder-fp32`` / ``folder-bf16`` serve models/SmolLM2-135M-Instruct's safetensors, ``gguf-fp32`` /
``gguf-bf16`` the Q4_1 GGUF beside it (``--gguf``). Measured per server: process start -> health SERVING (load),
tok/s over gRPC at batch 1 (or ``--batch`` prompts per request; prompts ``"Write a short story about a robot
number {i}."``, no chat template, greedy, ``ignore_eos``, exactly ``--new-tokens``; tok/s = generated tokens /
wall time of the round; warm median of ``--rounds``), and the server's peak RSS (``ru_maxrss`` from ``os.wait4`` in
a small launcher process, after SIGTERM).
Results: bench/results/gguf.json; the table in bench/README.md is copied from the printed summary.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
sys.path.insert(0, str(ROOT / "bench"))
from serve import server_env, wait_serving  # noqa: E402

LAUNCHER = """
import os, signal, subprocess, sys
child = subprocess.Popen(sys.argv[1:])
signal.signal(signal.SIGTERM, lambda *_: child.terminate())
print(os.wait4(child.pid, 0)[2].ru_maxrss)
"""  # runs argv, forwards SIGTERM, prints the child's peak RSS in KiB
CONFIGS: dict[str, list[str]] = {
    "folder-fp32": ["--dtype", "float32"],
    "folder-bf16": ["--dtype", "bfloat16"],
    "gguf-fp32": ["--dtype", "float32", "--gguf", str(GGUF)],
    "gguf-bf16": ["--dtype", "bfloat16", "--gguf", str(GGUF)],
    "gguf-fp32-eager": ["--dtype", "float32", "--gguf", str(GGUF), "--kernels", "eager"],
    "gguf-bf16-eager": ["--dtype", "bfloat16", "--gguf", str(GGUF), "--kernels", "eager"],
}


def timed_round(target: str, prompts: int, new_tokens: int, batch: int) -> float:
    """``prompts`` requests one after another, each of ``batch`` prompts (batched by the server): tok/s."""
    from loraplex import Client

    tokens = 0
    with Client(target, timeout=600) as client:
        start = time.perf_counter()
        for i in range(prompts):
            texts = [f"Write a short story about a robot number {i * batch + j}." for j in range(batch)]
            results = client.generate(texts, max_new_tokens=new_tokens, ignore_eos=True, return_token_ids=True)
            tokens += sum(len(r.token_ids) for r in results)
        wall = time.perf_counter() - start
    return tokens / wall


def run_one(name: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(args.model), "--port", str(port)]
    cmd += ["--metrics-port", "-1", "--max-batch-size", str(max(4, args.batch)), *CONFIGS[name]]
    env = server_env()
    start = time.monotonic()
    # Through a small launcher: Linux starts a child's peak RSS at its parent's RSS at fork, so a server forked
    # from a big process would report that process's size.
    launch = [sys.executable, "-c", LAUNCHER, *cmd]
    proc = subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready = wait_serving(f"127.0.0.1:{port}", start, args.timeout, proc)
        target = f"127.0.0.1:{port}"
        timed_round(target, 1, 4, args.batch)  # warm-up
        rates = [timed_round(target, args.prompts, args.new_tokens, args.batch) for _ in range(args.rounds)]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    return {
        "ready_seconds": ready,
        "tok_s": statistics.median(rates),
        "tok_s_all": rates,
        "peak_rss_mib": int(out.split()[-1]) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1, help="prompts per request, decoded together (default 1)")
    parser.add_argument("--port", type=int, default=50777)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gguf.json")
    args = parser.parse_args()
    results = {}
    for i, name in enumerate(args.configs):
        results[name] = run_one(name, args.port + i, args)
        r = results[name]
        print(
            f"{name:12s} ready {r['ready_seconds']:6.2f} s  peak RSS {r['peak_rss_mib']:7.1f} MiB  "
            f"batch {args.batch} {r['tok_s']:6.1f} tok/s  (rounds {', '.join(f'{x:.1f}' for x in r['tok_s_all'])})",
            flush=True,
        )
    if "folder-fp32" in results:
        base = results["folder-fp32"]
        for name, r in results.items():
            rss, rate = r["peak_rss_mib"] / base["peak_rss_mib"], r["tok_s"] / base["tok_s"]
            print(f"{name:12s} vs folder-fp32: RSS {rss:.2f}x, tok/s {rate:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
