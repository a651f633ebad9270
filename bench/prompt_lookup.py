"""Prompt-lookup drafting vs plain greedy decoding in the serving engine: decode tok/s, acceptance, identity.

    .venv/bin/python bench/prompt_lookup.py [--model models/SmolLM2-135M-Instruct] [--dtype float32]
        [--gguf models/SmolLM2-135M-Instruct.Q4_1.gguf] [--max-new 96] [--runs 3] [--ngram 3] [--tokens 8]
        [--threads 0] [--json OUT]

Code- and retrieval-like chat prompts (the answer copies much of the prompt: a function to return with one name
changed, a passage to quote) go one at a time through the engine in this process (``service.engine.Engine``,
no gRPC), greedy, in three modes: ``plain``; ``lookup`` (``--draft prompt-lookup``, drafting at every step);
``auto`` (the same, with the server's default speculation governor choosing plain or speculative steps). The
modes alternate within each run so that other load on the machine hits all alike; each figure is the median over
``--runs``. Decode tok/s counts each request's tokens after its first over the time from its first token to its
last (the prefill is excluded). Every drafted output is compared with the plain one (identical / prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import describe, line  # noqa: E402
from service import metrics  # noqa: E402
from service.bootstrap import WEIGHT_FORMATS  # noqa: E402
from service.config import Settings  # noqa: E402
from service.engine.engine import Engine  # noqa: E402
from service.engine.request import GenerationRequest, TokenEvent  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402

CODE = """def load_adapter(folder, roots, stamp=None):
    config = read_config(folder / "adapter_config.json")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise InvalidAdapter("no adapter_model.safetensors in the folder", file=folder)
    header = read_header(weights)
    for name, record in header.items():
        check_shape(name, record, config)
    return Spec(folder, config, header, stamp or make_stamp(weights))"""
PASSAGE = (
    "The engine owns one thread. Each step the scheduler retires cancelled rows, plans one prefill pass and "
    "decides whether rows draft. The runner builds the step's input tensors, runs the forward pass, and samples "
    "or verifies drafts. The output processor turns new tokens into events. Adapters load on their own threads, "
    "so a cold adapter never stalls the step; a row waits in the queue until its adapter is resident."
)
PROMPTS = (
    f"Rename the function load_adapter to load_lora and return the whole code, unchanged otherwise:\n\n{CODE}",
    f"Here is a passage:\n\n{PASSAGE}\n\nQuote the passage word for word.",
    f"Add a docstring to this function and return the full code:\n\n{CODE}",
)
MODES = ("plain", "lookup", "auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--gguf", type=Path, default=None, help="serve this GGUF's weights (the model folder's config)")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ngram", type=int, default=Settings().draft_ngram)
    ap.add_argument("--tokens", type=int, default=Settings().draft_tokens)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    # The folder, or a Q4_1 GGUF (in float32: what --dtype auto serves where the compiled kernels load).
    load = WEIGHT_FORMATS["folder" if args.gguf is None else "gguf"]
    model = load(Settings(model=args.model, gguf=args.gguf), dtype, torch.device("cpu"))[0]
    tok = Tokenizer.from_folder(args.model)
    prompts = [tuple(tok.encode_chat([{"role": "user", "content": p}])) for p in PROMPTS]
    print(f"{line()}; torch {torch.__version__}, threads {torch.get_num_threads()}, {args.dtype}")
    engines = {mode: make_engine(model, tok, args, mode) for mode in MODES}
    try:
        results = measure(engines, prompts, args)
    finally:
        for engine in engines.values():
            engine.stop(5)
    report(results)
    if args.json is not None:
        meta = {"machine": describe(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                "dtype": args.dtype, "gguf": None if args.gguf is None else args.gguf.name, "max_new": args.max_new,
                "runs": args.runs, "ngram": args.ngram,
                "tokens": args.tokens}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


def make_engine(model: Any, tok: Tokenizer, args: argparse.Namespace, mode: str) -> Engine:
    settings = Settings(
        model=args.model,
        max_batch_size=1,
        max_total_tokens=1024,
        max_prompt_tokens=512,
        prefix_cache_bytes=0,  # every run prefills alike
        draft="none" if mode == "plain" else "prompt-lookup",
        draft_ngram=args.ngram,
        draft_tokens=args.tokens,
        speculate_adaptive=mode == "auto",
    )
    engine = Engine(model, tok, settings)
    engine.start()
    return engine


def one(engine: Engine, prompt: tuple[int, ...], max_new: int, rid: str) -> tuple[list[int], int, float]:
    """(tokens, decode tokens, first -> last token seconds) of one greedy request."""
    times: list[float] = []

    def timed(event: TokenEvent) -> None:
        times.append(time.perf_counter())
        sink(event)

    events: list[TokenEvent] = []
    sink = events.append
    request = GenerationRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=max_new, ignore_eos=True)
    engine.submit(request, timed)
    while not events or events[-1].finish is None:
        time.sleep(0.001)
    tokens = [t for e in events for t in e.token_ids]
    first = next(i for i, e in enumerate(events) if e.token_ids)
    return tokens, len(tokens) - 1, times[-1] - times[first]


def measure(engines: dict[str, Engine], prompts: list[tuple[int, ...]], args: argparse.Namespace) -> dict[str, Any]:
    per_run: dict[str, list[float]] = {mode: [] for mode in MODES}
    accepted: dict[str, list[float]] = {mode: [] for mode in MODES}
    identical = {mode: 0 for mode in MODES}
    reference: dict[int, list[int]] = {}  # plain greedy tokens per prompt (the first run's)
    for run in range(args.runs):
        for mode in MODES:
            decode, seconds = 0, 0.0
            before = metrics.SPECULATIVE_ACCEPTED._value.get()
            for i, p in enumerate(prompts):
                tokens, n, s = one(engines[mode], p, args.max_new, f"{mode}-{run}-{i}")
                decode, seconds = decode + n, seconds + s
                if run == 0:
                    reference.setdefault(i, tokens)  # plain runs first
                    identical[mode] += tokens == reference[i]
            per_run[mode].append(decode / seconds)
            accepted[mode].append((metrics.SPECULATIVE_ACCEPTED._value.get() - before) / decode)
            print(f"run {run} {mode:>6}: {decode / seconds:7.1f} tok/s, accepted {accepted[mode][-1]:.2f} per token")
    return {
        mode: {
            "decode_tok_s_median": statistics.median(per_run[mode]),
            "decode_tok_s_runs": per_run[mode],
            "accepted_per_token": statistics.median(accepted[mode]),
            "identical": f"{identical[mode]}/{len(prompts)}",
        }
        for mode in MODES
    }


def report(results: dict[str, Any]) -> None:
    plain = results["plain"]["decode_tok_s_median"]
    print(f"{'mode':>6} {'tok/s (median)':>14} {'speed-up':>8} {'accepted/token':>14} {'identical':>9}")
    for mode, r in results.items():
        print(f"{mode:>6} {r['decode_tok_s_median']:14.1f} {r['decode_tok_s_median'] / plain:8.2f} "
              f"{r['accepted_per_token']:14.2f} {r['identical']:>9}")  # fmt: skip


if __name__ == "__main__":
    main()
