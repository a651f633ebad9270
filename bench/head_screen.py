"""A greedy step's argmax from the Q8_0 head: the full product and its row max against the int8 screen, same run.

    .venv/bin/python bench/head_screen.py [--rows 1 4 6 8 12 16 24 32 36 64] [--repeats 40] [--out FILE]

The default model's Q4_1 GGUF served in float32 (its tied Q8_0 head, 49152 x 576); the hidden states are the model's
own (the final-normed states of 32 prompts at every position of their prefill, taken ``rows`` at a time), so the
screen sees the candidates a served step sees. Per row count, interleaved call by call: ``full`` =
``Q8Table.project`` then ``NativeKernels.row_top`` (what a greedy step computed before), ``screened`` =
``Q8Table.top`` at every row count (served, it screens from ``SCREEN_MIN_ROWS``: where this table says it wins;
past ``NATIVE_MAX_ROWS`` rows the full path is the dense product over dequantized chunks, and the screen takes the
rows in kernel-sized chunks).
Each cell is the median of ``--repeats`` calls in ms; the table also gives the candidates the screen computed
exactly per row (median and largest; the JSON adds the rows counted) and the rows it left to the full product.
Every screened result is checked against the kernel's full product and row max (value bits and index). Needs
AVX-512 VNNI for the screen (the report says when the CPU has none: both columns are then the full path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import line

from service.kernels import native
from service.model import KVCache
from service.model.load_gguf import load_gguf_model
from service.model.weights import Q8Table
from service.model.weights.q8_table import NATIVE_MAX_ROWS
from service.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def hidden_states(model: torch.nn.Module, tokenizer: Tokenizer, n: int = 32) -> torch.Tensor:
    """[P, hidden] final-normed states of ``n`` prompts at every prompt position (bench/peers.py's prompts, longer)."""
    states = []
    for i in range(n):
        ids = tokenizer.encode(f"Write a short story about a robot number {i}. It woke up one morning and")
        cache = KVCache(model.cfg, 1, len(ids), dtype=torch.float32, device="cpu")
        with torch.inference_mode():
            states.append(model(torch.tensor([ids]), torch.arange(len(ids))[None, :], cache, 0)[0])
    return torch.cat(states)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 6, 8, 12, 16, 24, 32, 36, 64])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    kern = native.kernels()
    if kern is None:
        sys.exit(f"no compiled kernels: {native.status()}")
    model = load_gguf_model(MODEL, GGUF, dtype=torch.float32)[0]
    head = model.lm_head
    assert isinstance(head, Q8Table)
    states = hidden_states(model, Tokenizer.from_folder(MODEL))
    print(f"# {line()}; screen: {'AVX-512 VNNI' if kern.q8_screen else 'none on this CPU (both columns in full)'}")
    print("| rows | full ms | screened ms | ratio | candidates a row (median / max) | rows in full |")
    print("|---|---|---|---|---|---|")
    results = []
    for rows in args.rows:
        batches = [states[i : i + rows] for i in range(0, states.shape[0] - rows + 1, rows)]
        full_t, screen_t, found_all = [], [], []
        for k in range(args.repeats + 1):
            x = batches[k % len(batches)].contiguous()
            t0 = time.perf_counter()
            want = kern.row_top(head.project(x).float().contiguous())
            t1 = time.perf_counter()
            got = head.top(x, min_rows=1)  # the screen at every row count: where its threshold belongs
            t2 = time.perf_counter()
            if rows > NATIVE_MAX_ROWS[torch.float32]:  # the kernel's product, its rows at most the kernel's
                parts = x.split(NATIVE_MAX_ROWS[torch.float32])
                want = kern.row_top(
                    torch.cat([kern.q8_matmul(c.contiguous(), head.q, head.d, torch.float32) for c in parts])
                )
            if got is not None:
                same_bits = torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
                if not (same_bits and torch.equal(got[1], want[1])):
                    sys.exit(f"the screen disagrees with the full product at {rows} rows")
                found_all += got[2].tolist()
            if k:  # the first call builds the screen's copy and bounds
                full_t.append(t1 - t0)
                screen_t.append(t2 - t1)
        full, screened = statistics.median(full_t) * 1e3, statistics.median(screen_t) * 1e3
        found = [f for f in found_all if f > 0]
        cand = f"{statistics.median(found):.0f} / {max(found)}" if found else "-"
        in_full = sum(1 for f in found_all if f == 0)
        print(f"| {rows} | {full:.2f} | {screened:.2f} | {full / screened:.2f} | {cand} | {in_full} |", flush=True)
        summary = {"median": statistics.median(found), "max": max(found), "rows": len(found)} if found else None
        results.append({"rows": rows, "full_ms": full, "screened_ms": screened, "candidates": summary,
                        "rows_in_full": in_full})  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"machine": line(), "screen": kern.q8_screen, "results": results}, indent=1))


if __name__ == "__main__":
    main()
