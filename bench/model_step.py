"""One decode step of service.model vs transformers' own forward with its DynamicCache, same batch and context.

    .venv/bin/python bench/model_step.py [--model DIR] [--batch 1 32] [--dtype float32 bfloat16] [--threads N]

For each (dtype, batch): fill both caches with ``--context`` positions of random K/V per row (a prefill would cost
minutes at long contexts and does not change a step's cost), then time ``--steps`` decode
steps (forward + logits of the new token), alternating the two implementations step by step so that other load
on the machine hits both alike, and print median and best ms/step of each and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def make_ours(folder: Path, dtype: torch.dtype, batch: int, context: int, steps: int) -> Callable[[int], Any]:
    from service.model import KVCache
    from service.model.load_folder import load_model

    model, cfg, _ = load_model(folder, dtype=dtype, device="cpu")
    cache = KVCache(cfg, batch, context + steps + 1, dtype=dtype, device=model.device)
    gen = torch.Generator().manual_seed(0)
    cache.data.normal_(generator=gen)  # a context's worth of K/V (values do not change the cost of a step)
    nxt = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)

    def step(i: int) -> Any:
        pos = torch.full((batch, 1), context + i, dtype=torch.long)
        return model.logits(model(nxt, pos, cache, 0, kv_len=context + i + 1)[:, -1])

    return step


def make_hf(folder: Path, dtype: torch.dtype, batch: int, context: int, steps: int) -> Callable[[int], Any]:
    from transformers import DynamicCache, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(0)
    nxt = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen)
    cache = DynamicCache(config=model.config)
    shape = (batch, model.config.num_key_value_heads, context, model.config.head_dim)
    for layer in range(model.config.num_hidden_layers):
        k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
        cache.update(k, v, layer)

    def step(i: int) -> Any:
        return model(nxt, cache=cache, use_cache=True).logits.float()

    return step


def measure(folder: Path, dtype: torch.dtype, batch: int, context: int, steps: int) -> dict[str, list[float]]:
    """Alternate one step of each implementation, so that load from other processes hits both alike."""
    steppers = {
        "ours": make_ours(folder, dtype, batch, context, steps),
        "hf": make_hf(folder, dtype, batch, context, steps),
    }
    return interleaved_steps(steppers, steps)


def interleaved_steps(steppers: dict[str, Callable[[int], object]], steps: int) -> dict[str, list[float]]:
    """Seconds of steps 1..``steps`` of each stepper, one step of each in turn, after one warm-up step 0 each."""
    times: dict[str, list[float]] = {name: [] for name in steppers}
    with torch.inference_mode():
        for step in steppers.values():
            step(0)  # warm-up (rope table, allocator, first-call kernels)
        for i in range(1, steps + 1):
            for name, step in steppers.items():
                t0 = time.perf_counter()
                step(i)
                times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave the default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, context {args.context}, steps {args.steps}")
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for batch in args.batch:
            row = [f"{dtype_name:>8} B={batch:<3}"]
            times = measure(args.model, dtype, batch, args.context, args.steps)
            for name, ts in times.items():
                row.append(f"{name} median {statistics.median(ts) * 1e3:7.2f} ms best {min(ts) * 1e3:7.2f} ms")
            row.append(f"hf/ours best {min(times['hf']) / min(times['ours']):.2f}x")
            row.append(f"median {statistics.median(times['hf']) / statistics.median(times['ours']):.2f}x")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
