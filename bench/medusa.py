"""Medusa speculation vs plain greedy decoding on service.model: decode tok/s, mean accepted length, identity.

    .venv/bin/python bench/medusa.py [--model models/SmolLM2-135M-Instruct] [--heads adapters/demo/medusa]
        [--batch 1 4 16] [--prompts 16] [--max-new 128] [--speculate-max-batch 4] [--threads 2] [--json OUT]

The same held-out chat prompts (none of them is a training prompt of ``scripts/train_medusa_heads.py``) run through
``service.medusa.loop.generate`` at each batch size, in chunks of ``batch`` prompts, once without heads and once
with them; the two runs of a chunk alternate in order so that other load on the machine hits both alike. For
each batch size it prints decode tok/s (tokens after each row's first, over the decode time; the prefill is
excluded), the speed-up, the mean accepted length (tokens a row gains per step), the acceptance rate of drafted
tokens, and whether every output is token-identical to plain greedy. Where the batch is larger than
``--speculate-max-batch`` the speculative run switches speculation off, as the server does; a third run there
forces it on, to show why it is switched off.

This measures the speculative loop without the engine (no scheduler, no streaming, no gRPC): the served numbers
come from the engine's own benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.config import Settings  # noqa: E402
from service.medusa import MedusaHeads, generate, index_medusa  # noqa: E402
from service.medusa.loop import GenerationStats  # noqa: E402
from service.model.weights import load_model  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402

# Held out from training: different phrasings and subjects from the training script's.
PROMPTS = (
    "Tell me how a refrigerator keeps food cold.",
    "What makes a good night's sleep?",
    "Describe the life cycle of a butterfly.",
    "How do airplanes stay in the air?",
    "What are the benefits of learning a second language?",
    "Give me a simple recipe for pancakes.",
    "Why do leaves change color in autumn?",
    "How does a computer store information?",
    "What is the difference between weather and climate?",
    "Explain how a bill becomes a law.",
    "What are some ways to reduce stress at work?",
    "How do vaccines train the body?",
    "Describe a typical day of an astronaut on the space station.",
    "What causes thunder and lightning?",
    "How can I start running as a beginner?",
    "Why is the sky blue?",
    "What did ancient Egyptians eat?",
    "How does a credit card work?",
    "What are the main parts of a cell?",
    "How do solar panels produce electricity?",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--heads", type=Path, default=ROOT / "adapters" / "demo" / "medusa")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--speculate-max-batch", type=int, default=Settings().speculate_max_batch)
    ap.add_argument("--draft-threshold", type=float, default=0.0, help="see service.medusa.loop.generate")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.prompts > len(PROMPTS):
        raise SystemExit(f"--prompts {args.prompts}: only {len(PROMPTS)} prompts are defined")

    model, cfg, _ = load_model(args.model, dtype=torch.float32, device="cpu")
    heads = MedusaHeads.load(index_medusa(args.heads, cfg), device="cpu", dtype=torch.float32)
    tok = Tokenizer.from_folder(args.model)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
    eos = cfg.eos_token_ids
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {heads!r}")
    print(f"{len(prompts)} prompts x {args.max_new} new tokens, speculation off above batch {args.speculate_max_batch}")
    generate(model, prompts[:2], 8, heads=heads, eos_token_ids=eos)  # warm-up

    results = []
    header = (
        f"{'batch':>5} {'mode':>10} {'plain tok/s':>11} {'medusa tok/s':>12} {'speed-up':>8} {'accepted len':>12} "
        f"{'accept rate':>11} {'identical':>9}"
    )
    print(header)
    for batch in args.batch:
        modes = [("medusa", args.speculate_max_batch)]
        if batch > args.speculate_max_batch:
            modes = [("off", args.speculate_max_batch), ("forced", None)]
        for label, smb in modes:
            t0 = time.perf_counter()
            # Alternate which run goes first, chunk by chunk.
            plain_tokens: list[list[int]] = []
            spec_tokens: list[list[int]] = []
            plain_total, spec_total = GenerationStats(), GenerationStats()
            for i, start in enumerate(range(0, len(prompts), batch)):
                chunk = prompts[start : start + batch]
                pair = [("plain", None), ("spec", heads)]
                for name, h in pair if i % 2 == 0 else pair[::-1]:
                    out = generate(
                        model,
                        chunk,
                        args.max_new,
                        heads=h,
                        eos_token_ids=eos,
                        speculate_max_batch=smb,
                        draft_threshold=args.draft_threshold,
                    )
                    (plain_tokens if name == "plain" else spec_tokens).extend(out.tokens)
                    _add(plain_total if name == "plain" else spec_total, out.stats)
            identical = plain_tokens == spec_tokens
            p_tps, s_tps = plain_total.decode_tokens_per_second, spec_total.decode_tokens_per_second
            row = {
                "batch": batch,
                "mode": label,
                "plain_tok_s": round(p_tps, 2),
                "medusa_tok_s": round(s_tps, 2),
                "speedup": round(s_tps / p_tps, 3) if p_tps else None,
                "mean_accepted_length": round(spec_total.mean_accepted_length, 3),
                "acceptance_rate": round(spec_total.acceptance_rate, 3),
                "identical": identical,
                "decode_tokens": spec_total.decode_tokens,
                "seconds": round(time.perf_counter() - t0, 1),
            }
            results.append(row)
            print(
                f"{batch:>5} {label:>10} {p_tps:>11.1f} {s_tps:>12.1f} {row['speedup']:>7.2f}x "
                f"{spec_total.mean_accepted_length:>12.2f} {spec_total.acceptance_rate:>11.2f} {identical!s:>9}",
                flush=True,
            )
    if args.json is not None:
        meta = {
            "threads": torch.get_num_threads(),
            "prompts": len(prompts),
            "max_new": args.max_new,
            "heads": str(args.heads),
            "speculate_max_batch": args.speculate_max_batch,
            "draft_threshold": args.draft_threshold,
            "median_speedup": statistics.median(r["speedup"] or 0 for r in results),
        }
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


def _add(total: GenerationStats, part: GenerationStats) -> None:
    for name in ("steps", "row_steps", "drafted", "accepted", "verified_tokens", "new_tokens", "decode_tokens"):
        setattr(total, name, getattr(total, name) + getattr(part, name))
    total.prefill_seconds += part.prefill_seconds
    total.decode_seconds += part.decode_seconds


if __name__ == "__main__":
    main()
