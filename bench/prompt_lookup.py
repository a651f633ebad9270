"""Prompt-lookup drafting vs plain greedy decoding in the serving engine, per batch size: decode tok/s, identity.

    .venv/bin/python bench/prompt_lookup.py [--model models/SmolLM2-135M-Instruct] [--dtype float32]
        [--gguf models/SmolLM2-135M-Instruct.Q4_1.gguf] [--batch 1 4 8 16] [--workload copy chat]
        [--max-new 96] [--runs 3] [--ngram 3] [--tokens 8] [--threads 0] [--json OUT]

Two workloads: ``copy``, code- and retrieval-like chat prompts whose answer copies much of the prompt (a function
to return with one name changed, a passage to quote: where lookup pays), and ``chat``, the held-out chat prompts
of ``bench/medusa.py``, whose answers copy little (where drafts mostly fail and the governor must keep plain
steps). Each goes through the engine in this process (``service.engine.Engine``, no gRPC), greedy, in chunks of
``batch`` concurrent requests (the workload's prompts cycled to fill a chunk), in four modes:

- ``plain``: no drafter;
- ``lookup``: ``--draft prompt-lookup``, drafting at every step, whatever the batch size;
- ``auto``: the server's defaults, the speculation governor choosing plain or speculative steps at batch sizes up to
  ``--speculate-max-batch`` (4), plain above, and ``service.engine.draft_depth`` how deep a step verifies;
- ``governed``: the governor alone at every batch size (``--speculate-max-batch`` = the batch): whether the cap
  could be lifted.

The modes alternate within each run, each run starting one mode later, so that other load on the machine (and
the last mode's idle threads) hits all alike; each figure is the median
over ``--runs``. Every request runs ``--max-new`` tokens (EOS ignored); decode tok/s counts the tokens a chunk emits
after its last request's first token and until its first request's last, over that time: every row decoding, no
prefill in the window, and no tail where rows that accepted more drafts have finished and the batch runs smaller
(a server refills it). Every output is compared with plain's (identical rows / rows): in
float32 they must all be.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_medusa_heads import HELD_OUT_PROMPTS  # noqa: E402

from bench.machine import describe, line  # noqa: E402
from bench.medusa import submit_all  # noqa: E402
from service.bootstrap import WEIGHT_FORMATS  # noqa: E402
from service.config import Settings  # noqa: E402
from service.engine.engine import Engine  # noqa: E402
from service.engine.request import GenerationRequest  # noqa: E402
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
COPY_PROMPTS = (
    f"Rename the function load_adapter to load_lora and return the whole code, unchanged otherwise:\n\n{CODE}",
    f"Here is a passage:\n\n{PASSAGE}\n\nQuote the passage word for word.",
    f"Add a docstring to this function and return the full code:\n\n{CODE}",
)
WORKLOADS = {"copy": COPY_PROMPTS, "chat": HELD_OUT_PROMPTS}
MODES = ("plain", "lookup", "auto", "governed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--gguf", type=Path, default=None, help="serve this GGUF's weights (the model folder's config)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--workload", nargs="+", default=["copy"], choices=tuple(WORKLOADS))
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
    print(f"{line()}; torch {torch.__version__}, threads {torch.get_num_threads()}, {args.dtype}")
    print(f"{'workload':>8} {'batch':>5} {'mode':>8} {'tok/s':>7} {'vs plain':>8} {'accepted/token':>14} "
          f"{'identical':>9}")  # fmt: skip
    results = []
    for workload in args.workload:
        prompts = [tuple(tok.encode_chat([{"role": "user", "content": p}])) for p in WORKLOADS[workload]]
        for batch in args.batch:
            engines = {mode: make_engine(model, tok, args, mode, batch) for mode in MODES}
            try:
                rows = measure(engines, prompts, batch, args)
            finally:
                for engine in engines.values():
                    engine.stop(5)
            for row in rows:
                row.update(workload=workload, batch=batch)
                print(f"{workload:>8} {batch:>5} {row['mode']:>8} {row['decode_tok_s_median']:7.1f} "
                      f"{row['speed_up']:8.2f} {row['accepted_per_token']:14.2f} {row['identical']:>9}",
                      flush=True)  # fmt: skip
            results += rows
    if args.json is not None:
        meta = {"machine": describe(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                "dtype": args.dtype, "gguf": None if args.gguf is None else args.gguf.name, "max_new": args.max_new,
                "runs": args.runs, "ngram": args.ngram, "tokens": args.tokens,
                "speculate_max_batch": Settings().speculate_max_batch}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


def make_engine(model: Any, tok: Tokenizer, args: argparse.Namespace, mode: str, batch: int) -> Engine:
    settings = Settings(
        model=args.model,
        max_batch_size=batch,
        max_total_tokens=1024,
        max_prompt_tokens=512,
        prefix_cache_bytes=0,  # every run prefills alike
        draft="none" if mode == "plain" else "prompt-lookup",
        draft_ngram=args.ngram,
        draft_tokens=args.tokens,
        speculate_adaptive=mode in ("auto", "governed"),
        speculate_max_batch=Settings().speculate_max_batch if mode == "auto" else batch,
    )
    engine = Engine(model, tok, settings)
    engine.start()
    return engine


def chunks(prompts: list[tuple[int, ...]], batch: int) -> list[list[tuple[int, ...]]]:
    """At least ``len(prompts)`` requests in chunks of ``batch``, the prompts cycled to fill the last chunk."""
    n = -(-len(prompts) // batch) * batch
    cycled = [prompts[i % len(prompts)] for i in range(n)]
    return [cycled[i : i + batch] for i in range(0, n, batch)]


def run_batch(engine: Engine, prompts: list[tuple[int, ...]], max_new: int) -> tuple[list[list[int]], int, int, float]:
    """All prompts at once, each for ``max_new`` tokens: (tokens per prompt, tokens emitted while every row was
    decoding, drafted tokens accepted, the seconds from the last row's first token to the first row's last)."""
    requests = [
        GenerationRequest(request_id=f"r{i}", prompt_ids=p, max_new_tokens=max_new, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    events = submit_all(engine, requests)
    start = max(next(t for t, e in ev if e.token_ids) for ev in events)  # every row has its first token
    end = min(ev[-1][0] for ev in events)  # then rows that accepted more drafts finish first and the batch shrinks
    decoded = sum(len(e.token_ids) for ev in events for t, e in ev if start < t <= end)
    accepted = sum(ev[-1][1].accepted_draft_tokens for ev in events)
    return [[t for _, e in ev for t in e.token_ids] for ev in events], decoded, accepted, end - start


def measure(
    engines: dict[str, Engine], prompts: list[tuple[int, ...]], batch: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    per_run: dict[str, list[float]] = {mode: [] for mode in MODES}
    accepted: dict[str, list[float]] = {mode: [] for mode in MODES}
    outs: dict[str, list[list[int]]] = {}  # each mode's tokens per request (its first run's)
    reference: list[list[int]] = []  # plain greedy's
    work = chunks(prompts, batch)
    for engine in engines.values():
        run_batch(engine, work[0], 8)  # warm-up
    for run in range(args.runs):
        for mode in MODES[run % len(MODES) :] + MODES[: run % len(MODES)]:  # each run starts one mode later
            decode, seconds, drafted = 0, 0.0, 0
            outputs: list[list[int]] = []
            for chunk in work:
                tokens, n, a, s = run_batch(engines[mode], chunk, args.max_new)
                decode, seconds, drafted = decode + n, seconds + s, drafted + a
                outputs += tokens
            if mode == "plain":
                reference = reference or outputs
            outs[mode] = outs.get(mode) or outputs
            per_run[mode].append(decode / seconds)
            accepted[mode].append(drafted / (len(work) * batch * (args.max_new - 1)))
    identical = {mode: sum(a == b for a, b in zip(outs[mode], reference, strict=True)) for mode in MODES}
    plain = statistics.median(per_run["plain"])
    return [
        {
            "mode": mode,
            "decode_tok_s_median": statistics.median(per_run[mode]),
            "decode_tok_s_runs": per_run[mode],
            "speed_up": statistics.median(per_run[mode]) / plain,
            "accepted_per_token": statistics.median(accepted[mode]),
            "identical": f"{identical[mode]}/{len(reference)}",
        }
        for mode in MODES
    ]


if __name__ == "__main__":
    main()
