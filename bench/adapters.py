"""Adapter benchmark: mixed-adapter serving vs our base-only engine and vs `peft` mixed batches, in one run.

    .venv/bin/python bench/adapters.py            # full run (~10 min on 2 cores)
    .venv/bin/python bench/adapters.py --quick    # CI smoke: tiny counts, asserts sane numbers

Work: SmolLM2-135M-Instruct fp32, 32 PEFT LoRA adapters (r=8 on q_proj,v_proj — PEFT's default for Llama,
random non-zero weights) written by `peft` into bench/.work/adapters; chat prompts, greedy, 32 new tokens (EOS
ignored).
  (a) throughput at 32 concurrent gRPC streams (64 requests) vs the number of distinct adapters (1, 4, 16, 32; request
      i uses adapter i mod n), our base-only engine = 1.0; rounds alternate base / adapters, medians of the ratios;
  (b) the same mixed workload through `peft` (batch 32, `adapter_names=` one per row, and a single adapter);
  (c) cold vs warm time to first token (fresh server, each adapter's first request vs its second), and the
      inter-token latency of a running base stream while cold adapters load (a cold load must not stall others);
  (d) registering 1,000 adapters: time per registration and host memory, in a fresh process;
  (e) LoRA on every projection: ``--all-distinct`` (16) adapters r=8 on all seven projections (q, k, v, o, gate, up,
      down: the common PEFT choice; bench/.work/adapters-all), per ``--dtypes`` one server, rounds alternating
      base-only / all-projection mix at the same streams and requests, medians of the per-round ratios.
Results: bench/results/adapters.json; the table in bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import torch
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from serve import QUESTIONS, OurServer, pct, stream_request, summary  # noqa: E402

WORK = ROOT / "bench/.work"


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(
    model_dir: Path, folder: Path, count: int, *, r: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj")
) -> list[str]:
    """``count`` PEFT adapters on ``targets`` with seeded random A and B (peft would start B at 0)."""
    names = [f"lora{i:02d}" for i in range(count)]
    if all((folder / n / "adapter_model.safetensors").exists() for n in names):
        return names
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, name in enumerate(names):
        model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        model.save_pretrained(folder / name)
        base = model.unload()
    return names


async def stream_round(target: str, adapters: list[str | None], streams: int, new_tokens: int) -> dict[str, float]:
    """Run one request per entry of ``adapters`` with ``streams`` in flight; output tokens per second."""
    tokens = 0
    sem = asyncio.Semaphore(streams)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(i: int, adapter: str | None) -> None:
            nonlocal tokens
            req = stream_request(i, new_tokens, adapter or "")
            async with sem:
                async for msg in stub.GenerateStream(req):
                    tokens += len(msg.token_ids)

        start = time.perf_counter()
        await asyncio.gather(*(one(i, a) for i, a in enumerate(adapters)))
        wall = time.perf_counter() - start
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall}


async def first_token_seconds(stub: pb_grpc.GenerationStub, adapter: str | None, prompt: int) -> float:
    req = pb.GenerateStreamRequest(
        input=pb.Input(text=QUESTIONS[prompt % len(QUESTIONS)], chat=True),
        adapter_id=adapter or "",
        stopping=pb.StoppingCriteria(max_new_tokens=2, ignore_eos=True),
    )
    sent = time.perf_counter()
    first = None
    async for _ in stub.GenerateStream(req):
        if first is None:
            first = time.perf_counter() - sent
    assert first is not None
    return first


async def cold_vs_warm(target: str, names: list[str], background_tokens: int) -> dict[str, Any]:
    """Each adapter's first (cold) then second (warm) TTFT, while a base stream runs; that stream's ITL.

    The base stream's gaps are split by what else was in flight when each ended: nothing (quiet), a cold request
    (its adapter loading, then its prefill) or a warm one (its prefill only). A new request's prefill lengthens the
    running stream's step either way; what a cold load adds is the difference between the last two."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        gaps: list[tuple[float, float]] = []  # (end time, gap)

        async def background() -> None:
            req = pb.GenerateStreamRequest(
                input=pb.Input(text=QUESTIONS[0], chat=True),
                stopping=pb.StoppingCriteria(max_new_tokens=background_tokens, ignore_eos=True),
            )
            last = None
            async for _ in stub.GenerateStream(req):
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now, now - last))
                last = now

        task = asyncio.create_task(background())
        await asyncio.sleep(1.0)  # the base stream alone: its ITL without loads
        windows: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
        cold, warm = [], []
        for i, name in enumerate(names):
            for kind, out in (("cold", cold), ("warm", warm)):
                t0 = time.perf_counter()
                out.append(await first_token_seconds(stub, name, i))
                windows[kind].append((t0, time.perf_counter()))
                await asyncio.sleep(0.15)  # let the stream take a quiet step between requests
        await task

    def during(kind: str) -> list[float]:
        return [g for end, g in gaps if any(a < end <= b + 0.005 for a, b in windows[kind])]

    busy = windows["cold"] + windows["warm"]
    quiet = [g for end, g in gaps if not any(a < end <= b + 0.005 for a, b in busy)]
    out: dict[str, Any] = {
        "cold_ttft": summary(cold),
        "warm_ttft": summary(warm),
        "cold_over_warm": summary([c / w for c, w in zip(cold, warm, strict=True)]),
    }
    for kind, xs in (("quiet", quiet), ("warm", during("warm")), ("cold", during("cold"))):
        out[f"itl_{kind}_p50"] = pct(xs, 0.5)
        out[f"itl_{kind}_max"] = max(xs) if xs else float("nan")
        out[f"itl_{kind}_n"] = len(xs)
    return out


def peft_throughput(
    model_dir: Path, folder: Path, names: list[str], batch: int, new_tokens: int, repeats: int = 3
) -> dict[str, float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, folder / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(folder / name, adapter_name=name)
    model.eval()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS[:batch]
    ]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = {"mixed": [names[i % len(names)] for i in range(batch)], "single": [names[0]] * batch}

    def run(row_names: list[str], tokens: int) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            gen = model.generate(
                **enc,
                adapter_names=row_names,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
            seconds = time.perf_counter() - start
        return (gen.shape[1] - enc["input_ids"].shape[1]) * batch / seconds

    run(labels["mixed"], 2)  # warm-up
    got: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(repeats):  # alternating, as everywhere else
        for label, row_names in labels.items():
            got[label].append(run(row_names, new_tokens))
    return {f"{label}_tok_s": statistics.median(v) for label, v in got.items()}


REGISTER_CHILD = r"""
import json, os, sys, time, tracemalloc
from pathlib import Path
import torch
from service.adapters.lora import AdapterStore
from service.model.config import ModelConfig
model, root, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
def store():
    return AdapterStore(ModelConfig.from_hf(model), device=torch.device("cpu"), dtype=torch.float32,
                        device_budget_bytes=1 << 30, host_budget_bytes=1 << 30, roots=(root,))
def rss():  # resident bytes now (not the peak: torch's import set that long before)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
folders = sorted(p for p in root.iterdir() if p.is_dir())[:n]
timed = store()
rss0 = rss()
times = []
for i, folder in enumerate(folders):  # timed without tracing: tracemalloc slows every allocation
    t = time.perf_counter()
    timed.register(f"r{i:04d}", folder)
    times.append(time.perf_counter() - t)
growth = rss() - rss0
traced = store()
tracemalloc.start()
for i, folder in enumerate(folders):
    traced.register(f"r{i:04d}", folder)
current, _ = tracemalloc.get_traced_memory()
print(json.dumps({"n": len(times), "seconds": times, "traced_bytes": current, "rss_growth_bytes": growth}))
"""


def registration(model_dir: Path, source: Path, n: int) -> dict[str, Any]:
    """``n`` folders that each hold a copy of one adapter's config and a hard link to its weights."""
    root = WORK / "register"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    for i in range(n):
        d = root / f"a{i:04d}"
        d.mkdir()
        shutil.copy(source / "adapter_config.json", d)
        os.link(source / "adapter_model.safetensors", d / "adapter_model.safetensors")
    out = subprocess.run(
        [sys.executable, "-c", REGISTER_CHILD, str(model_dir), str(root), str(n)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    got = json.loads(out.stdout)
    secs = got["seconds"]
    return {
        "n": got["n"],
        "per_adapter_ms": {
            "median": statistics.median(secs) * 1e3,
            "p99": pct(secs, 0.99) * 1e3,
            "max": max(secs) * 1e3,
        },
        "total_s": sum(secs),
        "traced_MB": got["traced_bytes"] / 1e6,
        "rss_growth_MB": got["rss_growth_bytes"] / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models/SmolLM2-135M-Instruct")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--distinct", default="1,4,16,32")
    parser.add_argument("--register", type=int, default=1000)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/adapters.json")
    parser.add_argument("--parts", default="abcde", help="which of (a)-(e) to run; the others keep --out's figures")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="(e): one server per dtype")
    parser.add_argument("--all-distinct", type=int, default=16, help="(e): distinct all-projection adapters")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.new_tokens, args.streams, args.distinct, args.register = 1, 4, 4, "1,4", 20
        args.all_distinct, args.dtypes = 2, "float32"
    distinct = [int(x) for x in args.distinct.split(",")]
    folder = WORK / "adapters"
    names = write_adapters(args.model, folder, max(distinct))
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.parts != "abcde" and args.out.is_file() else {}
    results |= {
        "model": args.model.name,
        "adapters": f"{len(names)} x r=8 q_proj,v_proj",
        "streams": args.streams,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "load_avg_before": os.getloadavg(),
    }

    if "a" in args.parts:
        part_a(args, results, names, folder, distinct)
    if "b" in args.parts:
        part_b(args, results, names, folder, distinct)
    if "c" in args.parts:
        part_c(args, results, names, folder)
    if "d" in args.parts:
        part_d(args, results, names, folder)
    if "e" in args.parts:
        part_e(args, results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if "throughput" in results:
        print_table(results, distinct)
    print(f"wrote {args.out}; peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")
    if args.quick:
        assert all(results["throughput"][str(n)]["median"] > 0 for n in distinct)
        assert results["registration"]["n"] == args.register


def part_a(
    args: argparse.Namespace, results: dict[str, Any], names: list[str], folder: Path, distinct: list[int]
) -> None:
    """(a) throughput vs distinct adapters, base-only alternating as the reference."""
    srv = OurServer(args.model, "float32", 50810, args.streams, extra=["--adapter-dir", str(folder)])
    target = f"127.0.0.1:{srv.port}"
    requests = 2 * args.streams
    rows: dict[str, list[float]] = {}
    try:
        asyncio.run(stream_round(target, list(names), args.streams, 2))  # every adapter resident
        for r in range(args.runs + 1):
            base = asyncio.run(stream_round(target, [None] * requests, args.streams, args.new_tokens))["tok_s"]
            for n in distinct:
                mix = [names[i % n] for i in range(requests)]
                got = asyncio.run(stream_round(target, mix, args.streams, args.new_tokens))["tok_s"]
                if r:
                    rows.setdefault(f"{n}", []).append(got)
                    rows.setdefault(f"ratio_{n}", []).append(got / base)
            if r:
                rows.setdefault("base", []).append(base)
            print(f"(a) round {r}: base {base:.1f} tok/s", flush=True)
    finally:
        srv.stop()
    results["throughput"] = {k: summary(v) for k, v in rows.items()}


def part_b(
    args: argparse.Namespace, results: dict[str, Any], names: list[str], folder: Path, distinct: list[int]
) -> None:
    """(b) peft mixed batch, same prompts and lengths."""
    pf = peft_throughput(args.model, folder, names, args.streams, args.new_tokens)
    results["peft"] = pf
    ours_mixed = results["throughput"][str(max(distinct))]["median"]
    results["ours_vs_peft_mixed"] = ours_mixed / pf["mixed_tok_s"]
    print(f"(b) peft mixed {pf['mixed_tok_s']:.1f} tok/s, single {pf['single_tok_s']:.1f}; ours/peft mixed "
          f"{results['ours_vs_peft_mixed']:.1f}x", flush=True)  # fmt: skip


def part_c(args: argparse.Namespace, results: dict[str, Any], names: list[str], folder: Path) -> None:
    """(c) cold vs warm TTFT on a fresh server, a base stream running meanwhile; twice: as served (a warm request
    also finds its adapter's system-prompt K/V in the prefix cache, a cold one cannot) and with the prefix cache
    off (both prefill the whole prompt: the difference is the adapter load alone)."""
    for key, extra in (("cold_vs_warm", []), ("cold_vs_warm_no_prefix_cache", ["--prefix-cache-bytes", "0"])):
        srv = OurServer(args.model, "float32", 50811, args.streams, extra=["--adapter-dir", str(folder), *extra])
        try:
            cw = asyncio.run(cold_vs_warm(f"127.0.0.1:{srv.port}", names[: min(8, len(names))], 256))
        finally:
            srv.stop()
        results[key] = cw
        print(f"(c) {key}: cold/warm TTFT median {cw['cold_over_warm']['median']:.2f}x "
              f"({cw['cold_ttft']['median'] * 1e3:.0f} / {cw['warm_ttft']['median'] * 1e3:.0f} ms); running stream "
              f"ITL p50/max: quiet {cw['itl_quiet_p50'] * 1e3:.1f}/{cw['itl_quiet_max'] * 1e3:.1f} ms, during warm "
              f"requests {cw['itl_warm_p50'] * 1e3:.1f}/{cw['itl_warm_max'] * 1e3:.1f} ms, during cold requests "
              f"{cw['itl_cold_p50'] * 1e3:.1f}/{cw['itl_cold_max'] * 1e3:.1f} ms", flush=True)  # fmt: skip


def part_d(args: argparse.Namespace, results: dict[str, Any], names: list[str], folder: Path) -> None:
    """(d) registration of many adapters."""
    reg = registration(args.model, folder / names[0], args.register)
    results["registration"] = reg
    print(f"(d) {reg['n']} registrations: median {reg['per_adapter_ms']['median']:.2f} ms, max "
          f"{reg['per_adapter_ms']['max']:.2f} ms, RSS +{reg['rss_growth_MB']:.1f} MB, "
          f"Python heap +{reg['traced_MB']:.1f} MB", flush=True)  # fmt: skip


def part_e(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """(e) all-projection adapters vs base-only, per dtype, interleaved rounds on one server."""
    folder = WORK / "adapters-all"
    names = write_adapters(args.model, folder, args.all_distinct, targets=ALL_PROJECTIONS)
    requests = 2 * args.streams
    out: dict[str, Any] = {"adapters": f"{len(names)} x r=8 on {','.join(ALL_PROJECTIONS)}"}
    for dtype in args.dtypes.split(","):
        srv = OurServer(args.model, dtype, 50812, args.streams, extra=["--adapter-dir", str(folder)])
        target = f"127.0.0.1:{srv.port}"
        rows: dict[str, list[float]] = {"base": [], "mix": [], "ratio": []}
        try:
            asyncio.run(stream_round(target, list(names), args.streams, 2))  # every adapter resident
            mix = [names[i % len(names)] for i in range(requests)]
            for r in range(args.runs + 1):  # round 0 warms up
                base = asyncio.run(stream_round(target, [None] * requests, args.streams, args.new_tokens))["tok_s"]
                got = asyncio.run(stream_round(target, mix, args.streams, args.new_tokens))["tok_s"]
                if r:
                    rows["base"].append(base)
                    rows["mix"].append(got)
                    rows["ratio"].append(got / base)
                print(f"(e) {dtype} round {r}: base {base:.1f} tok/s, all-projection mix {got:.1f}", flush=True)
        finally:
            srv.stop()
        out[dtype] = {k: summary(v) for k, v in rows.items()}
        print(f"(e) {dtype}: {args.streams} streams over {len(names)} all-projection adapters = "
              f"{out[dtype]['ratio']['median']:.2f}x base-only (median of {args.runs})", flush=True)  # fmt: skip
    results["all_projections"] = out


def print_table(results: dict[str, Any], distinct: list[int]) -> None:
    t = results["throughput"]
    print("\n| distinct adapters | tok/s (median, min–max) | vs base-only (median of pairs) |")
    print("|---|---|---|")
    print(f"| 0 (base only) | {t['base']['median']:.1f} ({t['base']['min']:.1f}–{t['base']['max']:.1f}) | 1.00 |")
    for n in distinct:
        row, ratio = t[str(n)], t[f"ratio_{n}"]
        print(f"| {n} | {row['median']:.1f} ({row['min']:.1f}–{row['max']:.1f}) | {ratio['median']:.2f} |")


if __name__ == "__main__":
    main()
