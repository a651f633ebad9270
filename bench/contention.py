"""Throughput with and without a noisy neighbour: one core taken by a busy loop, same servers, same run.

    .venv/bin/python bench/contention.py                     # the issue's table: 4 variants, 5 rounds (~6 min)
    .venv/bin/python bench/contention.py --quick             # smoke: one short round, asserts sane numbers
    .venv/bin/python bench/contention.py --rounds 5 --streams 32 --new-tokens 32 --dtype bfloat16
    .venv/bin/python bench/contention.py --variant 'spin30k:GOMP_SPINCOUNT=30000:--threads 2 --no-adaptive-threads'

Each variant is one `loraplex serve` subprocess (its flags and OpenMP environment), all started once and kept
running. Every round visits the variants in turn (A B C ... each round, so drift hits all alike); per variant it
measures output tok/s of ``--requests`` greedy requests (``--new-tokens`` each, EOS ignored) with ``--streams``
in flight, first quiet, then with a neighbour: ``sh -c 'while :; do :; done'`` under ``timeout`` (so it dies even
if this script does), started before and killed right after the contended measurement. A measurement that does
not finish within ``--round-timeout`` seconds is cut there (its RPCs cancelled) and counts tokens / timeout, a
lower bound, flagged ``cut``.

Reported per variant (medians over rounds): quiet tok/s, contended tok/s, contended / quiet (per round, then
median), and quiet / the ``threads-spin`` variant's quiet in the same round. Results: bench/results/contention.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from loraplex.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
CPUS = len(os.sched_getaffinity(0))
PROMPTS = 16  # the first 16 of serve.py's questions, cycled
sys.path.insert(0, str(ROOT / "bench"))
from serve import run_record, serve_command, server_env, stop_server, stream_request, wait_serving  # noqa: E402

# libgomp's own behaviour when neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set: spin 300000 iterations.
LIBGOMP_DEFAULT = {"GOMP_SPINCOUNT": "300000"}
FIXED = ["--threads", str(CPUS), "--no-adaptive-threads"]
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "default": ({}, []),  # today's defaults: the CLI's GOMP_SPINCOUNT, the thread governor
    "threads-spin": (LIBGOMP_DEFAULT, FIXED),  # before: torch's count, libgomp's own spinning, fixed
    "threads-1": (LIBGOMP_DEFAULT, ["--threads", "1"]),
    "threads-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, FIXED),
    # the parts of the default alone (--variants default,fixed-spin10k,adaptive-libgomp,...)
    "fixed-spin10k": ({"GOMP_SPINCOUNT": "10000"}, FIXED),
    "adaptive-libgomp": (LIBGOMP_DEFAULT, []),
    "adaptive-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
}
DEFAULT_VARIANTS = "default,threads-spin,threads-1,threads-passive"
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")


@dataclass
class Server:
    name: str
    env: dict[str, str]
    flags: list[str]
    port: int
    proc: subprocess.Popen[bytes] | None = None
    quiet: list[float] = field(default_factory=list)
    contended: list[float] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)

    def start(self, model: Path, dtype: str, streams: int, log_dir: Path | None) -> None:
        env = server_env({k: v for k, v in os.environ.items() if k not in OMP_VARS} | self.env)
        args = serve_command(model, dtype, self.port, streams)
        args += ["--max-total-tokens", "1024", "--max-prompt-tokens", "512", *self.flags]
        log = subprocess.DEVNULL if log_dir is None else (log_dir / f"{self.name}.log").open("wb")
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=log)

    def stop(self) -> None:
        stop_server(self.proc)


async def measure(target: str, streams: int, requests: int, new_tokens: int, timeout: float) -> tuple[float, bool]:
    """Output tok/s of ``requests`` streams, ``streams`` in flight; (tokens / timeout, True) when cut."""
    tokens = 0
    sem = asyncio.Semaphore(streams)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            nonlocal tokens
            req = stream_request(i % PROMPTS, new_tokens)
            async with sem:
                async for msg in stub.GenerateStream(req):
                    tokens += len(msg.token_ids)

        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(requests))), timeout)
        except TimeoutError:
            return tokens / timeout, True
        return tokens / (time.perf_counter() - start), False


class Neighbour:
    """One busy loop for at most ``limit`` seconds (``timeout`` kills it even if this process dies)."""

    def __init__(self, limit: float) -> None:
        cmd = ["timeout", str(int(limit)), "sh", "-c", "while :; do :; done"]
        self.proc = subprocess.Popen(cmd, start_new_session=True)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


async def run_round(servers: list[Server], args: argparse.Namespace, record: bool) -> None:
    for srv in servers:
        target = f"127.0.0.1:{srv.port}"
        # "Quiet" means quiet: the previous server and neighbour are done, and this server's idle engine has
        # seen them stop (its thread governor looks at the last idle wait's CPU use when work resumes).
        await asyncio.sleep(1.0)
        quiet, q_cut = await measure(target, args.streams, args.requests, args.new_tokens, args.round_timeout)
        if q_cut:
            await asyncio.sleep(3.0)  # let the server retire the cancelled rows
        neighbour = Neighbour(args.round_timeout + 30)
        try:
            await asyncio.sleep(0.5)  # the scheduler sees the neighbour before the first step
            busy, b_cut = await measure(target, args.streams, args.requests, args.new_tokens, args.round_timeout)
        finally:
            neighbour.stop()
        if b_cut:
            await asyncio.sleep(3.0)
        print(f"  {srv.name:<18} quiet {quiet:7.1f} tok/s   neighbour {busy:7.1f} tok/s", flush=True)
        if record:
            srv.quiet.append(quiet)
            srv.contended.append(busy)
            srv.cut += [f"quiet round {len(srv.quiet)}"] * q_cut + [f"contended round {len(srv.quiet)}"] * b_cut


async def run_rounds(servers: list[Server], args: argparse.Namespace) -> None:
    for r in range(args.rounds + 1):
        print(f"round {r}{' (warm-up)' if r == 0 else ''}", flush=True)
        await run_round(servers, args, record=r > 0)


def summarize(servers: list[Server]) -> dict[str, Any]:
    ref = next((s for s in servers if s.name == "threads-spin"), None)
    out: dict[str, Any] = {}
    for s in servers:
        d: dict[str, Any] = {
            "env": s.env,
            "flags": s.flags,
            "quiet_tok_s": s.quiet,
            "contended_tok_s": s.contended,
            "quiet_median": statistics.median(s.quiet),
            "contended_median": statistics.median(s.contended),
            "contended_over_quiet": statistics.median(b / q for q, b in zip(s.quiet, s.contended, strict=True)),
            "cut": s.cut,
        }
        if ref is not None:
            pairs = zip(s.quiet, ref.quiet, strict=True)
            d["quiet_over_threads_spin_quiet"] = statistics.median(q / r for q, r in pairs)
        out[s.name] = d
    return out


def print_table(summary: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n{args.streams} streams x {args.new_tokens} tokens, {args.dtype}, {CPUS} CPUs, medians of {args.rounds}")
    print("| server | env | quiet tok/s | one core taken tok/s | taken / quiet | quiet / threads-spin quiet |")
    print("|---|---|---|---|---|---|")
    for name, d in summary.items():
        env = " ".join(f"{k}={v}" for k, v in d["env"].items()) or "-"
        flags = " ".join(d["flags"]) or "(default flags)"
        cut = " (cut)" if any(c.startswith("contended") for c in d["cut"]) else ""
        ref = d.get("quiet_over_threads_spin_quiet")
        print(
            f"| {name}: `{flags}` | {env} | {d['quiet_median']:.0f} | {d['contended_median']:.0f}{cut} "
            f"| {d['contended_over_quiet']:.2f} | {'-' if ref is None else f'{ref:.2f}'} |"
        )


def parse_variant(spec: str) -> tuple[str, dict[str, str], list[str]]:
    """``NAME:ENV=V,ENV=V:--flag v ...`` (either part may be empty)."""
    name, _, rest = spec.partition(":")
    env_part, _, flags = rest.partition(":")
    env = dict(item.split("=", 1) for item in env_part.split(",") if item)
    return name, env, flags.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up round)")
    parser.add_argument("--streams", type=int, default=32, help="requests in flight")
    parser.add_argument("--requests", type=int, default=0, help="requests per measurement (default 2 x streams)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--round-timeout", type=float, default=60.0, help="cut a measurement after this many s")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"built-in variants: {', '.join(VARIANTS)}")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:ENV=V,...:FLAGS", help="add one")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/contention.json")
    parser.add_argument("--log-dir", type=Path, help="keep each server's log (thread switches) here")
    parser.add_argument("--quick", action="store_true", help="1 round, 4 streams x 8 tokens, 2 variants")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.streams, args.new_tokens, args.variants, args.round_timeout = 1, 4, 8, "default,threads-1", 30
        args.out = Path("/tmp/loraplex-contention-quick.json")
    args.requests = args.requests or 2 * args.streams
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    specs = [(n, *VARIANTS[n]) for n in args.variants.split(",") if n] + [parse_variant(v) for v in args.variant]
    servers = [Server(name, env, flags, 50870 + i) for i, (name, env, flags) in enumerate(specs)]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = os.getloadavg()
    try:
        for srv in servers:
            srv.start(args.model, args.dtype, args.streams, args.log_dir)
        for srv in servers:
            wait_serving(f"127.0.0.1:{srv.port}", time.monotonic(), 180.0)
        asyncio.run(run_rounds(servers, args))
    finally:
        for srv in servers:
            srv.stop()
    summary = summarize(servers)
    print_table(summary, args)
    result = {
        **run_record("bench/contention.py", started, load_before),
        "dtype": args.dtype,
        "streams": args.streams,
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "variants": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.quick:
        assert all(d["quiet_median"] > 0 and d["contended_median"] > 0 for d in summary.values()), summary


if __name__ == "__main__":
    main()
