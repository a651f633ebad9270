"""Serving benchmark: loraplex over loopback gRPC vs `transformers` `generate`, side by side.

    .venv/bin/python bench/serve.py                 # fp32 and bf16, 5 measured rounds each (~8 min on 2 cores)
    .venv/bin/python bench/serve.py --quick         # CI smoke: one short round, asserts sane numbers

Per dtype, one `loraplex serve` subprocess and one `transformers` model in this process run the same chat prompts
(64 distinct questions: across requests only the chat template's system prompt repeats; greedy, exactly
``--new-tokens`` new tokens: EOS ignored), alternating A B A B each round:
  * ours at 1, 8 and 32 concurrent gRPC streams (``2 x streams`` requests each, a semaphore keeps ``streams`` in
    flight): output tok/s, TTFT and inter-token latency p50/p99;
  * transformers ``generate`` at batch 1 (sequential) and at padded batch 32 (left padding): output tok/s;
  * our engine in-process (no gRPC) at 1 stream: the per-token cost gRPC streaming adds.
Also: process start -> health SERVING (fresh `loraplex serve` processes), and the memory-bandwidth bound
(every decode step streams all weights once: bound tok/s = batch x bandwidth / weight bytes).
Results: bench/results/serve.json; the table in bench/README.md is copied from the printed summary.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import machine as bench_machine
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Name three primary colors.",
    "How do plants make food?", "What is a prime number?", "Explain gravity in one sentence.",
    "What does a CPU do?", "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
    "How many legs does a spider have?", "What is photosynthesis?", "Give me a synonym for happy.",
    "What is the largest ocean?", "How does a rainbow form?", "What is an atom?", "Why do we sleep?",
    "What is the speed of light?", "Name a famous painter.", "What is machine learning?", "How do bees help flowers?",
    "What is the tallest mountain?", "Why is exercise healthy?", "What language is spoken in Brazil?",
    "How does a compass work?", "What is a volcano?", "Describe a cat in one sentence.",
    "What is the moon made of?", "What causes tides?", "What is democracy?", "How do vaccines work?",
    "What is the Pythagorean theorem?", "Why do leaves change color?",
    "What is a black hole?", "How do airplanes fly?", "What is the capital of Japan?", "Why is the ocean salty?",
    "What does DNA stand for?", "How do magnets work?", "Name two planets with rings.", "What is inflation?",
    "Who painted the Mona Lisa?", "How does the heart pump blood?", "What is a haiku?", "Why do cats purr?",
    "What is the smallest prime number?", "How are clouds formed?", "What is an echo?", "Why do we have seasons?",
    "What is a noun?", "How does a refrigerator work?", "Name a renewable energy source.", "What is a fossil?",
    "How do fish breathe?", "What is the freezing point of water?", "Who was Albert Einstein?", "What is a galaxy?",
    "How do birds migrate?", "What is an adjective?", "Why is sleep important for memory?", "What is a desert?",
    "How does recycling help?", "What is the largest animal?", "What are vitamins?", "How does sound travel?",
]  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


# --- ours over gRPC -------------------------------------------------------------------------------------------
class OurServer:
    def __init__(self, model: Path, dtype: str, port: int, max_batch: int, extra: list[str] | None = None) -> None:
        self.port = port
        self.start = time.monotonic()
        # `python -m service.cli` from ROOT: the checkout's own code (a worktree's too), not what .venv installed
        args = serve_command(model, dtype, port, max_batch)
        args += ["--max-total-tokens", "1024", "--max-prompt-tokens", "512", *(extra or [])]
        self.proc = subprocess.Popen(args, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=ROOT)
        self.ready_seconds = wait_serving(f"127.0.0.1:{port}", self.start)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def run_record(script: str, started: str, load_before: tuple[float, float, float]) -> dict[str, Any]:
    """The head of a result file: the command line, when it began, the machine and its load before and now."""
    return {
        "command": " ".join([script, *sys.argv[1:]]),
        "started": started,
        "cpus": len(os.sched_getaffinity(0)),
        "machine": bench_machine.describe(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
    }


def serve_command(model: Path, dtype: str, port: int, max_batch: int) -> list[str]:
    """``loraplex serve`` on gRPC ``port`` alone (no metrics or HTTP listener); callers append their flags."""
    args = [sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--dtype", dtype, "--port", str(port)]
    return [*args, "--metrics-port", "-1", "--http-port", "-1", "--max-batch-size", str(max_batch)]


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the checkout and its client first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "clients/python"), env.get("PYTHONPATH", "")])
    return env


def stop_server(proc: subprocess.Popen[Any] | None) -> None:
    """SIGTERM a server still running, SIGKILL it if it has not exited 30 s later."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_serving(target: str, start: float, timeout: float = 120.0, proc: subprocess.Popen[Any] | None = None) -> float:
    """Seconds from ``start`` until ``target`` reports SERVING; RuntimeError as soon as ``proc`` has exited."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() - start < timeout:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before SERVING")
            try:
                req = health_pb2.HealthCheckRequest(service="loraplex.v1.Generation")
                if stub.Check(req, timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - start
            except grpc.RpcError:
                pass
            time.sleep(0.01)
    raise TimeoutError(f"server at {target} not SERVING after {timeout} s")


def stream_request(i: int, new_tokens: int, adapter: str = "") -> pb.GenerateStreamRequest:
    """Question ``i`` (cycling) as a chat stream of exactly ``new_tokens`` tokens (EOS ignored), token ids returned."""
    return pb.GenerateStreamRequest(
        input=pb.Input(text=QUESTIONS[i % len(QUESTIONS)], chat=True),
        adapter_id=adapter,
        stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
        return_options=pb.ReturnOptions(return_token_ids=True),
    )


async def grpc_round(target: str, streams: int, requests: int, new_tokens: int) -> dict[str, Any]:
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    sem = asyncio.Semaphore(streams)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            nonlocal tokens
            req = stream_request(i, new_tokens)
            async with sem:
                sent = time.perf_counter()
                last = sent
                async for msg in stub.GenerateStream(req):
                    now = time.perf_counter()
                    if msg.token_ids:
                        if last == sent:
                            ttft.append(now - sent)
                        else:
                            itl.append(now - last)
                        last = now
                        tokens += len(msg.token_ids)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - start
    return {
        "tok_s": tokens / wall,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "itl_p50": pct(itl, 0.5),
        "itl_p99": pct(itl, 0.99),
        "itl_mean": statistics.fmean(itl) if itl else float("nan"),
        "tokens": tokens,
    }


# --- ours in-process ------------------------------------------------------------------------------------------
def inprocess_itl(model_dir: Path, dtype: str, new_tokens: int, reps: int) -> list[float]:
    from service.config import Settings
    from service.engine.engine import Engine
    from service.engine.request import GenerationRequest
    from service.model.load_folder import load_model
    from service.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(model_dir)
    model, _, _ = load_model(model_dir, dtype=getattr(torch, dtype), device=torch.device("cpu"))
    settings = Settings(model=model_dir, dtype=dtype, max_batch_size=1, max_total_tokens=1024, max_prompt_tokens=512)
    engine = Engine(model, tok, settings)
    engine.start()
    means = []
    try:
        for r in range(reps + 1):
            prompt = tok.encode(
                tok.apply_chat_template([{"role": "user", "content": QUESTIONS[r]}]), add_special_tokens=False
            )
            stamps: list[float] = []
            done = threading.Event()

            def sink(event: Any, stamps: list[float] = stamps, done: threading.Event = done) -> None:
                stamps.append(time.perf_counter())
                if event.finish is not None:
                    done.set()

            engine.submit(
                GenerationRequest(
                    request_id=f"b{r}", prompt_ids=tuple(prompt), max_new_tokens=new_tokens, ignore_eos=True
                ),
                sink,
            )
            done.wait(300)
            gaps = [b - a for a, b in itertools.pairwise(stamps)]
            if r > 0:  # first is warm-up
                means.append(statistics.fmean(gaps))
    finally:
        engine.stop()
    return means


def inprocess_itl_subprocess(model_dir: Path, dtype: str, new_tokens: int, reps: int) -> list[float]:
    """``inprocess_itl`` in a fresh process, as the server runs: not in this one, whose OpenMP pool and allocator
    the transformers runs have shaped."""
    args = [sys.executable, __file__, "--inprocess", dtype, "--model", str(model_dir), "--new-tokens", str(new_tokens)]
    out = subprocess.run([*args, "--runs", str(reps)], check=True, capture_output=True, text=True).stdout
    return list(json.loads(out.strip().splitlines()[-1]))


# --- transformers ---------------------------------------------------------------------------------------------
class HF:
    def __init__(self, model_dir: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.prompts = [
            self.tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS
        ]

    @torch.inference_mode()
    def run(self, batch: int, requests: int, new_tokens: int) -> dict[str, Any]:
        tokens = 0
        start = time.perf_counter()
        for i in range(0, requests, batch):
            texts = [self.prompts[j % len(self.prompts)] for j in range(i, i + batch)]
            enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = self.model.generate(
                **enc,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.tok.pad_token_id,
            )
            tokens += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
        return {"tok_s": tokens / (time.perf_counter() - start), "tokens": tokens}


def memory_bandwidth() -> float:
    """Bytes/s of a large tensor copy (read + write counted), the practical bound for streaming weights."""
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models/SmolLM2-135M-Instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--starts", type=int, default=5, help="fresh processes timed to SERVING")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/serve.json")
    parser.add_argument("--inprocess", metavar="DTYPE", help=argparse.SUPPRESS)  # the in-process run's child
    args = parser.parse_args()
    if args.inprocess:
        print(json.dumps(inprocess_itl(args.model, args.inprocess, args.new_tokens, args.runs)))
        return
    if args.quick:
        args.runs, args.new_tokens, args.streams, args.starts, args.dtypes = 1, 8, "1,4", 1, "float32"
    streams = [int(s) for s in args.streams.split(",")]
    torch.set_num_threads(os.cpu_count() or 2)
    bandwidth = memory_bandwidth()
    results: dict[str, Any] = {
        "model": str(args.model.name),
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "threads": torch.get_num_threads(),
        "memory_bandwidth_GBs": bandwidth / 1e9,
        "load_avg_before": os.getloadavg(),
        "dtypes": {},
    }
    print(f"memory bandwidth (copy) {bandwidth / 1e9:.1f} GB/s; load average {os.getloadavg()}", flush=True)

    starts = []
    for i in range(args.starts):
        srv = OurServer(args.model, "float32", 50700 + i, 32)
        starts.append(srv.ready_seconds)
        srv.stop()
    results["start_to_serving_s"] = summary(starts)
    print(f"start -> SERVING: median {statistics.median(starts):.2f} s (min {min(starts):.2f}, max {max(starts):.2f})")

    for dtype in args.dtypes.split(","):
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        hf = HF(args.model, dtype)
        weight_bytes = sum(p.numel() for p in hf.model.parameters()) * itemsize
        srv = OurServer(args.model, dtype, 50790, max(streams))
        target = f"127.0.0.1:{srv.port}"
        rows: dict[str, list[dict[str, Any]]] = {}
        try:
            for r in range(args.runs + 1):  # round 0 is the warm-up
                for s in streams:
                    reqs = 2 * s if s > 1 else 4
                    got = asyncio.run(grpc_round(target, s, reqs, args.new_tokens))
                    if r:
                        rows.setdefault(f"ours_{s}", []).append(got)
                    hf_batch = 1 if s == 1 else 32
                    if s in (1, max(streams)):
                        hf_got = hf.run(hf_batch, 4 if hf_batch == 1 else reqs, args.new_tokens)
                        if r:
                            rows.setdefault(f"hf_{hf_batch}", []).append(hf_got)
                print(f"[{dtype}] round {r} done", flush=True)
        finally:
            srv.stop()
        del hf
        inproc = inprocess_itl_subprocess(args.model, dtype, args.new_tokens, args.runs)
        d: dict[str, Any] = {"weight_bytes": weight_bytes}
        for key, vals in rows.items():
            d[key] = {m: summary([v[m] for v in vals]) for m in vals[0]}
        for s in streams:
            hf_key = "hf_1" if s == 1 else "hf_32"
            if s in (1, max(streams)) and hf_key in rows and f"ours_{s}" in rows:
                ratios = [o["tok_s"] / h["tok_s"] for o, h in zip(rows[f"ours_{s}"], rows[hf_key], strict=True)]
                d[f"ratio_ours_{s}_vs_{hf_key}"] = summary(ratios)
            bound = s * bandwidth / 2 / weight_bytes  # read bandwidth = copy bandwidth / 2 per direction
            d[f"bound_tok_s_{s}"] = bound
            d[f"fraction_of_bound_{s}"] = d[f"ours_{s}"]["tok_s"]["median"] / bound
        d["inprocess_itl_mean_s"] = summary(inproc)
        d["grpc_overhead_per_token_ms"] = (d["ours_1"]["itl_mean"]["median"] - statistics.median(inproc)) * 1e3
        results["dtypes"][dtype] = d
        print_dtype(dtype, d, streams)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.quick:
        for d in results["dtypes"].values():
            assert d["ours_1"]["tok_s"]["median"] > 0 and d["hf_1"]["tok_s"]["median"] > 0


def print_dtype(dtype: str, d: dict[str, Any], streams: list[int]) -> None:
    print(f"\n== {dtype}: weights {d['weight_bytes'] / 1e6:.0f} MB")
    print(
        "| streams | ours tok/s | transformers tok/s | ratio (median of pairs) | TTFT p50 | ITL p50 | ITL p99 "
        "| bound tok/s | of bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for s in streams:
        o = d[f"ours_{s}"]
        hf_key = "hf_1" if s == 1 else "hf_32"
        hf = d.get(hf_key, {}).get("tok_s", {}).get("median", float("nan"))
        ratio = d.get(f"ratio_ours_{s}_vs_{hf_key}", {}).get("median")
        vs = f"{hf:.1f} (batch {1 if s == 1 else 32}) | {ratio:.2f}×" if ratio is not None else "– | –"
        print(
            f"| {s} | {o['tok_s']['median']:.1f} ({o['tok_s']['min']:.1f}–{o['tok_s']['max']:.1f}) | "
            f"{vs} | {o['ttft_p50']['median'] * 1e3:.0f} ms | "
            f"{o['itl_p50']['median'] * 1e3:.1f} ms | {o['itl_p99']['median'] * 1e3:.1f} ms | "
            f"{d[f'bound_tok_s_{s}']:.0f} | {d[f'fraction_of_bound_{s}']:.0%} |"
        )
    print(
        f"gRPC streaming overhead per token at 1 stream: {d['grpc_overhead_per_token_ms']:.2f} ms "
        f"(in-process mean ITL {d['inprocess_itl_mean_s']['median'] * 1e3:.2f} ms)"
    )


if __name__ == "__main__":
    main()
