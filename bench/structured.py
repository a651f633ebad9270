"""Structured output, side by side: 32 streams over 16 LoRAs, each with its own JSON schema, against the same rows
unconstrained, in one run; and vLLM's CPU backend on the same rows and schemas.

    .venv/bin/python bench/structured.py                # loraplex and vLLM (bench/.work/vllm, built once)
    .venv/bin/python bench/structured.py --engines loraplex --runs 5

What it reports (bench/results/structured.json, and one line per figure):
  * compile: llguidance compile time of 32 typical schemas (5 to 50 properties) and of a 50-property one, and a
    cache hit (``GrammarCache.get`` of a compiled schema), in this process;
  * throughput: tok/s of the 32 streams (``bench/structured_workload.py``: exactly ``NEW_TOKENS`` tokens each, so
    both sides generate the same tokens), free and constrained batches alternating, the median of ``--runs``
    after a warm-up; every constrained run brings new schemas (each compiles on first use);
  * time to first token of one stream alone, without a schema and with a schema never seen before, alternating;
  * validity: 32 typical schemas, greedy, up to 400 tokens with a chat prompt: outputs that finish, and how many of
    those ``jsonschema`` validates;
  * vLLM: the same free and constrained batches through ``vllm.LLM`` (its default structured-output backend).
The loraplex server runs as a child (``loraplex serve``, ``--dtype`` as given), the peer in its own venv; both
take the whole machine in turn, never at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine as bench_machine
import peers_envs as envs
from peers import child_env, log, preloads, run_child
from peers_loraplex import Server, free_port
from structured_workload import NEW_TOKENS, prompt, schema, schema_text, typical_schema

ROOT = Path(__file__).resolve().parent.parent


def compile_figures(model: Path) -> dict[str, Any]:
    """Compile times of typical schemas and a cache hit, with the server's own backend and cache."""
    from service.config import Settings
    from service.constraints.cache import GrammarCache
    from service.constraints.llg import LLGuidanceBackend
    from service.constraints.spec import Constraint
    from service.model.config import ModelConfig
    from service.tokenizer import Tokenizer

    tokenizer, cfg = Tokenizer.from_folder(model), ModelConfig.from_hf(model)
    start = time.perf_counter()
    eos = sorted(set(tokenizer.eos_token_ids) | set(cfg.eos_token_ids))
    backend = LLGuidanceBackend(tokenizer.to_json(), cfg.vocab_size, eos, max_depth=Settings().max_constraint_depth)
    setup_s = time.perf_counter() - start
    typical = []
    for i in range(32):
        c = Constraint("json_schema", schema_text(typical_schema(i, 5 + (45 * i) // 31)))
        t = time.perf_counter()
        backend.compile(c)
        typical.append(time.perf_counter() - t)
    fifty = []
    for i in range(7):
        c = Constraint("json_schema", schema_text(typical_schema(100 + i, 50)))
        t = time.perf_counter()
        backend.compile(c)
        fifty.append(time.perf_counter() - t)
    cache = GrammarCache(backend, 64 << 20)
    hot = Constraint("json_schema", schema_text(typical_schema(7, 50)))
    cache.get(hot)
    hits = []
    for _ in range(1000):
        t = time.perf_counter()
        cache.get(hot)
        hits.append(time.perf_counter() - t)
    return {
        "tokenizer_setup_ms": setup_s * 1e3,
        "typical_compile_ms": {"median": statistics.median(typical) * 1e3, "max": max(typical) * 1e3},
        "fifty_properties_compile_ms": statistics.median(fifty) * 1e3,
        "cache_hit_us": statistics.median(hits) * 1e6,
    }


async def _batch(target: str, streams: int, adapters: list[str], salt: str | None) -> tuple[float, float]:
    """All streams at once (schemas salted ``salt``; None: free); (tok/s, median time to first token)."""
    from loraplex import AsyncClient

    async with AsyncClient(target) as client:
        await client.health()

        async def one(i: int) -> tuple[int, float]:
            kw: dict[str, Any] = {} if salt is None else {"json_schema": schema(i, salt)}
            first, count, t = 0.0, 0, time.perf_counter()
            async for delta in client.stream(
                prompt(i), adapter=adapters[i % len(adapters)] if adapters else None, max_new_tokens=NEW_TOKENS,
                ignore_eos=True, temperature=0.0, return_token_ids=True, timeout=600, **kw,
            ):  # fmt: skip
                if not count and delta.token_ids:
                    first = time.perf_counter() - t
                count += len(delta.token_ids)
            return count, first

        start = time.perf_counter()
        outs = await asyncio.gather(*(one(i) for i in range(streams)))
        wall = time.perf_counter() - start
    counts = [c for c, _ in outs]
    if counts != [NEW_TOKENS] * streams:
        raise RuntimeError(f"loraplex: token counts {counts}, expected {NEW_TOKENS} each")
    return streams * NEW_TOKENS / wall, statistics.median(f for _, f in outs)


async def _first_token(target: str, salt: str | None) -> float:
    from loraplex import AsyncClient

    async with AsyncClient(target) as client:
        await client.health()
        kw: dict[str, Any] = {} if salt is None else {"json_schema": typical_schema(abs(hash(salt)) % 10_000, 30)}
        t = time.perf_counter()
        stream = client.stream(prompt(0), max_new_tokens=2, temperature=0.0, return_token_ids=True, timeout=60, **kw)
        async for delta in stream:
            if delta.token_ids:
                return time.perf_counter() - t
    raise RuntimeError("no token")


async def _validity(target: str, count: int) -> dict[str, int]:
    import jsonschema
    from loraplex import AsyncClient

    finished = valid = 0
    async with AsyncClient(target) as client:
        for i in range(count):
            s = typical_schema(500 + i, 5 + i % 10)
            messages = [{"role": "user", "content": f"Describe robot number {i} as JSON."}]
            result = await client.generate(messages, max_new_tokens=400, temperature=0.0, json_schema=s, timeout=600)
            if result.finish_reason == "eos":
                finished += 1
                try:
                    jsonschema.validate(json.loads(result.text), s)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
    return {"schemas": count, "finished": finished, "valid": valid}


def run_loraplex(args: argparse.Namespace, loras: list[Path]) -> dict[str, Any]:
    adapters = [p.name for p in loras]
    flags = ["--dtype", args.dtype, "--max-batch-size", str(args.streams)]
    server = Server(args.model, flags, loras[0].parent if loras else None, free_port(), args.work / "structured.log")
    free: list[float] = []
    constrained: list[float] = []
    ttft_batch: dict[str, list[float]] = {"free": [], "constrained": []}
    try:
        for run in range(args.runs + 1):  # run 0 warms up
            f_tps, f_ttft = asyncio.run(_batch(server.target, args.streams, adapters, None))
            c_tps, c_ttft = asyncio.run(_batch(server.target, args.streams, adapters, f"r{run}-{time.time_ns()}"))
            log(f"loraplex run {run}: free {f_tps:.1f} tok/s, constrained {c_tps:.1f} tok/s")
            if run:
                free.append(f_tps)
                constrained.append(c_tps)
                ttft_batch["free"].append(f_ttft)
                ttft_batch["constrained"].append(c_ttft)
        alone: dict[str, list[float]] = {"none": [], "new_schema": []}
        for k in range(args.ttft_samples):
            alone["none"].append(asyncio.run(_first_token(server.target, None)))
            alone["new_schema"].append(asyncio.run(_first_token(server.target, f"t{k}-{time.time_ns()}")))
        validity = asyncio.run(_validity(server.target, args.validity_schemas))
        rss = server.peak_rss()
    finally:
        server.stop()
    free_tps, cons_tps = statistics.median(free), statistics.median(constrained)
    ttft = {k: statistics.median(v) for k, v in alone.items()}
    return {
        "free_tok_s": free_tps,
        "constrained_tok_s": cons_tps,
        "ratio": cons_tps / free_tps,
        "runs": {"free": free, "constrained": constrained},
        "batch_ttft_s": {k: statistics.median(v) for k, v in ttft_batch.items()},
        "ttft_alone_s": ttft,
        "ttft_ratio": ttft["new_schema"] / ttft["none"],
        "validity": validity,
        "peak_rss_bytes": rss,
    }


def run_vllm(args: argparse.Namespace, loras: list[Path]) -> dict[str, Any]:
    env = envs.vllm_env(args.work, log)
    if env.python is None:
        return {"skipped": env.reason}
    libs, _ = preloads(env.python)
    extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "LD_PRELOAD": ":".join(libs)}
    spec = {
        "model": str(args.model),
        "dtype": args.vllm_dtype,
        "streams": args.streams,
        "adapters": [str(p) for p in loras],
        "lora_rank": 8,
        "runs": args.runs,
    }
    out = run_child(env.python, "structured_vllm.py", spec, child_env(extra), timeout=1800)
    if out.get("free"):
        out["free_tok_s"] = statistics.median(out["free"])
        out["constrained_tok_s"] = statistics.median(out["constrained"])
        out["ratio"] = out["constrained_tok_s"] / out["free_tok_s"]
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models/SmolLM2-135M-Instruct")
    p.add_argument("--engines", default="loraplex,vllm", help="comma list of loraplex, vllm")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--adapters", type=int, default=16, help="LoRAs the streams are spread over (0 = base model)")
    p.add_argument("--runs", type=int, default=3, help="measured runs of each batch (after one warm-up)")
    p.add_argument("--ttft-samples", type=int, default=9)
    p.add_argument("--validity-schemas", type=int, default=32)
    p.add_argument("--dtype", default="auto", help="loraplex serve --dtype")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--smoke", action="store_true", help="compile figures only, no server (tests/bench)")
    p.add_argument("--work", type=Path, default=ROOT / "bench/.work")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/structured.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    result: dict[str, Any] = {"machine": {**bench_machine.describe(), "load_avg_before": os.getloadavg()}}
    result["compile"] = compile_figures(args.model)
    log(f"compile: {json.dumps(result['compile'])}")
    if not args.smoke:
        args.work.mkdir(parents=True, exist_ok=True)
        loras = envs.write_loras(args.model, args.work, args.adapters, log=log) if args.adapters else []
        engines = args.engines.split(",")
        if "loraplex" in engines:
            result["loraplex"] = run_loraplex(args, loras)
        if "vllm" in engines:
            result["vllm"] = run_vllm(args, loras)
        if "ratio" in result.get("loraplex", {}) and "constrained_tok_s" in result.get("vllm", {}):
            result["constrained_vs_vllm"] = (
                result["loraplex"]["constrained_tok_s"] / result["vllm"]["constrained_tok_s"]
            )
        result["machine"]["load_avg_after"] = os.getloadavg()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
