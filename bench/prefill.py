"""Chunked prefill: running streams' inter-token latency while long prompts arrive, chunking on vs off, same run.

    .venv/bin/python bench/prefill.py                # 8 streams, a 2000-token prompt every second, 2 rounds (~3 min)
    .venv/bin/python bench/prefill.py --quick        # smoke: 1 short round, 4 streams, 600-token prompts
    .venv/bin/python bench/prefill.py --streams 16 --chunk 512 --dtype bfloat16

Two `loraplex serve` subprocesses over the same model, started once: ``--prefill-chunk-tokens CHUNK`` (on) and
``--prefill-chunk-tokens 0`` (off: whole prompts). Each round visits both (A B, then B A) and per server:
``--streams`` greedy chat streams (serve.py's questions, EOS ignored) decode for ``--quiet`` seconds, then for
``--busy`` seconds a fresh ``--prompt-tokens``-token prompt (seeded random words, different from its first token
on, so the prefix cache never helps) arrives every ``--interval`` seconds (one new token each, a unary
Generate). Recorded: the gap between consecutive tokens of the streams in each phase (ITL p50 / p99; a busy
gap is one that overlaps the busy phase, so the stall a stream is in when the arrivals stop counts: the arrivals
are cancelled and each stream's next token awaited, at most ``--tail`` seconds, a gap still open then counting as
that long), the streams' output tok/s, and each arrival's time to its token. Then every RPC is cancelled and a
one-token probe waits until the server has retired them. Where arrivals offer more prefill work than the
CPUs do, they queue (``arrivals done`` < sent): the streams' ITL is what the run is about. Results:
bench/results/prefill.json; the table in bench/README.md is copied from the printed summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
CPUS = len(os.sched_getaffinity(0))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from serve import pct, run_record, serve_command, server_env, stop_server, stream_request, wait_serving  # noqa: E402

from service.tokenizer import Tokenizer  # noqa: E402

WORDS = [
    "river", "stone", "light", "paper", "window", "garden", "music", "number", "yellow", "market", "silver",
    "engine", "doctor", "forest", "question", "winter", "animal", "letter", "summer", "circle", "island",
    "mountain", "orange", "planet", "rocket", "bridge",
]  # fmt: skip


@dataclass
class Server:
    name: str
    chunk: int
    port: int
    proc: subprocess.Popen[bytes] | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)

    def start(self, args: argparse.Namespace) -> None:
        env = server_env()
        cmd = serve_command(args.model, args.dtype, self.port, args.streams + 8)
        cmd += ["--max-prompt-tokens", str(args.prompt_tokens + 64), "--max-total-tokens", "4096"]
        cmd += ["--prefill-chunk-tokens", str(self.chunk)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        stop_server(self.proc)


def long_prompt(tokenizer: Tokenizer, seed: int, tokens: int) -> str:
    """About ``tokens`` tokens of seeded random words (no chat template)."""
    rng = random.Random(seed)
    words = [f"Note {seed}:"] + [rng.choice(WORDS) for _ in range(tokens * 2)]
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:tokens]
    return tokenizer.decode(ids)


async def measure(target: str, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One measurement on one server: the quiet phase, then the busy phase (see the module docstring)."""
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    ttft: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def stream(i: int) -> None:
            async for msg in stub.GenerateStream(stream_request(i, args.stream_tokens)):
                if msg.token_ids:
                    stamps[i].append(time.perf_counter())

        async def arrival(text: str) -> None:
            request = pb.GenerateRequest(
                inputs=[pb.Input(text=text)], stopping=pb.StoppingCriteria(max_new_tokens=1, ignore_eos=True)
            )
            sent = time.perf_counter()
            await stub.Generate(request)
            ttft.append(time.perf_counter() - sent)

        streams = [asyncio.create_task(stream(i)) for i in range(args.streams)]
        while not all(len(s) >= 2 for s in stamps):  # every stream admitted and decoding
            await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        await asyncio.sleep(args.quiet)
        t1 = time.perf_counter()
        arrivals = []
        for text in prompts:
            arrivals.append(asyncio.create_task(arrival(text)))
            await asyncio.sleep(args.interval)
        t2 = time.perf_counter()
        for task in arrivals:
            task.cancel()
        # The gap a stream is in at t2 belongs to the busy phase too: wait for every stream's next token.
        while not all(s[-1] > t2 for s in stamps) and time.perf_counter() < t2 + args.tail:
            await asyncio.sleep(0.05)
        t3 = time.perf_counter()
        for task in [*streams, *arrivals]:
            task.cancel()
        for task in [*streams, *arrivals]:
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await task
        probe = pb.GenerateRequest(inputs=[pb.Input(text="hi")], stopping=pb.StoppingCriteria(max_new_tokens=1))
        await stub.Generate(probe, timeout=300)  # behind whatever pass was running: the cancelled rows are gone
    quiet = [b - a for s in stamps for a, b in itertools.pairwise(s) if t0 <= a and b < t1]
    busy = [b - a for s in stamps for a, b in itertools.pairwise(s) if b > t1 and a < t2]
    cut = [t3 - s[-1] for s in stamps if s[-1] <= t2]  # still waiting at the tail's end: a lower bound
    busy += cut
    return {
        "quiet_itl_p50": pct(quiet, 0.5),
        "quiet_itl_p99": pct(quiet, 0.99),
        "busy_itl_p50": pct(busy, 0.5),
        "busy_itl_p99": pct(busy, 0.99),
        "busy_itl_max": max(busy, default=float("nan")),
        "quiet_tok_s": sum(t0 <= t < t1 for s in stamps for t in s) / (t1 - t0),
        "busy_tok_s": sum(t1 <= t < t2 for s in stamps for t in s) / (t2 - t1),
        "arrivals_sent": len(prompts),
        "arrivals_done": len(ttft),
        "arrival_ttft_p50": pct(ttft, 0.5),
        "streams_cut": len(cut),
    }


async def run_rounds(servers: list[Server], prompts: list[list[str]], args: argparse.Namespace) -> None:
    for r in range(args.rounds + 1):
        order = servers if r % 2 == 0 else servers[::-1]
        print(f"round {r}{' (warm-up)' if r == 0 else ''}", flush=True)
        for srv in order:
            await asyncio.sleep(1.0)
            m = await measure(f"127.0.0.1:{srv.port}", prompts[r], args)
            print(
                f"  {srv.name:<4} quiet ITL p50 {m['quiet_itl_p50'] * 1e3:6.0f} p99 {m['quiet_itl_p99'] * 1e3:6.0f} ms"
                f" | busy p50 {m['busy_itl_p50'] * 1e3:6.0f} p99 {m['busy_itl_p99'] * 1e3:6.0f} ms"
                f" | {m['busy_tok_s']:5.1f} tok/s | arrivals {m['arrivals_done']}/{m['arrivals_sent']}",
                flush=True,
            )
            if r > 0:
                srv.rounds.append(m)


def summarize(on: Server, off: Server) -> dict[str, Any]:
    keys = on.rounds[0].keys()
    out: dict[str, Any] = {
        s.name: {"chunk": s.chunk, "rounds": s.rounds, **{k: statistics.median(m[k] for m in s.rounds) for k in keys}}
        for s in (on, off)
    }
    pairs = list(zip(on.rounds, off.rounds, strict=True))
    out["off_over_on"] = {
        k: statistics.median(b[k] / a[k] for a, b in pairs)
        for k in ("busy_itl_p50", "busy_itl_p99", "busy_itl_max", "quiet_itl_p99")
    }
    out["on_over_off_busy_tok_s"] = statistics.median(a["busy_tok_s"] / b["busy_tok_s"] for a, b in pairs)
    return out


def print_table(s: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n{args.streams} streams, a {args.prompt_tokens}-token prompt every {args.interval:g} s for {args.busy:g} s, "
        f"{args.dtype}, {CPUS} CPUs, medians of {args.rounds} rounds"
    )
    print("| prefill | quiet ITL p50 / p99 ms | busy ITL p50 / p99 / max ms | busy stream tok/s | arrivals done |")
    print("|---|---|---|---|---|")
    for name in ("on", "off"):
        d = s[name]
        label = f"chunks of {d['chunk']}" if d["chunk"] else "whole prompts"
        print(
            f"| {label} | {d['quiet_itl_p50'] * 1e3:.0f} / {d['quiet_itl_p99'] * 1e3:.0f} "
            f"| {d['busy_itl_p50'] * 1e3:.0f} / {d['busy_itl_p99'] * 1e3:.0f} / {d['busy_itl_max'] * 1e3:.0f} "
            f"| {d['busy_tok_s']:.1f} | {d['arrivals_done']:.0f} / {d['arrivals_sent']:.0f} |"
        )
    r = s["off_over_on"]
    print(
        f"off / on (per round, median): busy ITL p50 {r['busy_itl_p50']:.2f}x, p99 {r['busy_itl_p99']:.2f}x, "
        f"max {r['busy_itl_max']:.2f}x; on / off busy stream tok/s {s['on_over_off_busy_tok_s']:.2f}x"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunk", type=int, default=256, help="--prefill-chunk-tokens of the 'on' server")
    parser.add_argument("--streams", type=int, default=8, help="decode streams running throughout")
    parser.add_argument("--stream-tokens", type=int, default=1024, help="max_new_tokens of each stream")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="length of each arriving prompt")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between arrivals")
    parser.add_argument("--quiet", type=float, default=6.0, help="seconds of streams alone")
    parser.add_argument("--busy", type=float, default=12.0, help="seconds of arrivals")
    parser.add_argument("--tail", type=float, default=60.0, help="most seconds to wait for the gap open at the end")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds (after one warm-up round)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/prefill.json")
    parser.add_argument("--quick", action="store_true", help="1 short round, 4 streams, 600-token prompts")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.streams, args.prompt_tokens, args.quiet, args.busy = 1, 4, 600, 2.0, 4.0
        args.out = Path("/tmp/loraplex-prefill-quick.json")
    return args


def main() -> None:
    args = parse_args()
    tokenizer = Tokenizer.from_folder(args.model)
    per_round = round(args.busy / args.interval)
    prompts = [
        [long_prompt(tokenizer, 1000 * r + i, args.prompt_tokens) for i in range(per_round)]
        for r in range(args.rounds + 1)
    ]  # the same arrivals for both servers within a round; new ones each round (no prefix-cache hit across)
    on, off = Server("on", args.chunk, 50890), Server("off", 0, 50891)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = os.getloadavg()
    try:
        for srv in (on, off):
            srv.start(args)
        for srv in (on, off):
            wait_serving(f"127.0.0.1:{srv.port}", time.monotonic(), 180.0)
        asyncio.run(run_rounds([on, off], prompts, args))
    finally:
        for srv in (on, off):
            srv.stop()
    summary = summarize(on, off)
    print_table(summary, args)
    result = {
        **run_record("bench/prefill.py", started, load_before),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.quick:
        assert all(summary[n]["quiet_itl_p50"] > 0 and summary[n]["busy_tok_s"] > 0 for n in ("on", "off")), summary


if __name__ == "__main__":
    main()
