"""Before / after in one run: the same serving workload against this checkout and an earlier commit, alternating.

    .venv/bin/python bench/compare_trees.py --base 559ba0d             # ~6 min on 2 cores
    .venv/bin/python bench/compare_trees.py --base main~5 --runs 3 --configs gguf

A refactor must leave the hot path within noise; judging that from two runs on different days (or under different
load) is hopeless on a shared VM. This script checks ``--base`` out into ``bench/.work/tree-<sha>`` (a detached git
worktree), starts one ``loraplex serve`` from each tree (its own code first on ``PYTHONPATH``) for each config,
and then measures them in turns — A B, B A, A B, ... — so that whatever else the machine does hits both alike:
  * gRPC ``GenerateStream`` at 1 and 8 concurrent streams (output tok/s, greedy, exactly ``--new-tokens``);
  * OpenAI HTTP ``/v1/chat/completions`` (non-streamed, one at a time: requests/s).
It prints the medians of ``--runs`` rounds and the ratio after / before; ``bench/results/compare_trees.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import serve as bench_serve

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "gguf": ["--gguf", "models/SmolLM2-135M-Instruct.Q4_1.gguf", "--weights", "auto", "--dtype", "auto"],
    "float32": ["--dtype", "float32"],
}


def base_tree(rev: str) -> Path:
    """A detached worktree of ``rev`` under bench/.work (made once, reused while ``rev`` names the same commit)."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    tree = ROOT / "bench/.work" / f"tree-{sha.strip()[:12]}"
    if not (tree / "service").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha.strip()], cwd=ROOT, check=True)
    models = tree / "models"
    if not models.exists():
        models.symlink_to(ROOT / "models")
    return tree


class Server:
    """``loraplex serve`` from ``tree``'s own code, gRPC on ``port`` and HTTP on ``port + 1``."""

    def __init__(self, tree: Path, port: int, flags: list[str]) -> None:
        self.target = f"127.0.0.1:{port}"
        self.http_port = port + 1
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "clients/python")])
        args = [sys.executable, "-m", "service.cli", "serve", "--model", "models/SmolLM2-135M-Instruct"]
        args += ["--port", str(port), "--http-port", str(port + 1), "--metrics-port", "-1", "--max-batch-size", "8"]
        start = time.monotonic()
        log = (ROOT / "bench/.work" / f"compare-{port}.log").open("w")  # its log, for when it fails to start
        self.proc = subprocess.Popen([*args, *flags], cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=log)
        bench_serve.wait_serving(self.target, start, timeout=300, proc=self.proc)

    def stop(self) -> None:
        bench_serve.stop_server(self.proc)


def chat_once(port: int, i: int, new_tokens: int) -> None:
    question = bench_serve.QUESTIONS[i % len(bench_serve.QUESTIONS)]
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        reply = conn.getresponse()
        data = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {data[:200]!r}")
    finally:
        conn.close()


def http_round(port: int, requests: int, new_tokens: int) -> float:
    """Requests per second of ``requests`` non-streamed chat completions, one after the other."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        list(pool.map(lambda i: chat_once(port, i, new_tokens), range(requests)))
    return requests / (time.perf_counter() - start)


def measure(server: Server, streams: list[int], new_tokens: int) -> dict[str, float]:
    got = {}
    for s in streams:
        row = asyncio.run(bench_serve.grpc_round(server.target, s, 2 * s if s > 1 else 4, new_tokens))
        got[f"grpc_{s}_tok_s"] = row["tok_s"]
    got["http_chat_req_s"] = http_round(server.http_port, 4, new_tokens)
    return got


def compare(base: Path, flags: list[str], args: argparse.Namespace) -> dict[str, Any]:
    streams = [int(s) for s in args.streams.split(",")]
    servers = {"before": Server(base, 50810, flags), "after": Server(ROOT, 50820, flags)}
    rounds: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    try:
        for srv in servers.values():  # warm-up: first calls compile / fault pages in
            measure(srv, streams, args.new_tokens)
        for r in range(args.runs):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for name in order:
                rounds[name].append(measure(servers[name], streams, args.new_tokens))
    finally:
        for srv in servers.values():
            srv.stop()
    out: dict[str, Any] = {}
    for key in rounds["before"][0]:
        a = statistics.median(x[key] for x in rounds["before"])
        b = statistics.median(x[key] for x in rounds["after"])
        runs = {name: [x[key] for x in rows] for name, rows in rounds.items()}
        out[key] = {"before": a, "after": b, "ratio": b / a, "runs": runs}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare against (any git revision)")
    parser.add_argument("--configs", default="gguf,float32", help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/compare_trees.json")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()
    base = base_tree(args.base)
    results: dict[str, Any] = {"base": args.base, "configs": {}}
    for config in args.configs.split(","):
        got = compare(base, CONFIGS[config], args)
        results["configs"][config] = got
        for key, v in got.items():
            spread = "  ".join(f"{n} {min(r):.2f}-{max(r):.2f}" for n, r in v["runs"].items())
            line = f"before {v['before']:8.2f}  after {v['after']:8.2f}  after/before {v['ratio']:.3f}  ({spread})"
            print(f"{config:8} {key:18} {line}")
    results.update(bench_serve.run_record("bench/compare_trees.py", started, load_before))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
