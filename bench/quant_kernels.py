"""Weight-only quantized kernels vs dense matmuls on SmolLM2-135M's projection shapes, by rows M.

    .venv/bin/python bench/quant_kernels.py [--rows 1 2 4 ...] [--dtype float32 bfloat16] [--repeats 30]
    .venv/bin/python bench/quant_kernels.py --model models/SmolLM2-135M-Instruct [--batch 1 32] [--dtype bfloat16]

For each dtype and M, one layer's four projections (wqkv 960x576, wo 576x576, w13 3072x576, w2 576x1536) are run
through: the dense weight (``F.linear``), the int8 and int4 (group 32) kernels, and the dense path a quantized
weight takes from ``dense_from_rows`` on (dequantize into one reused scratch buffer, then ``F.linear``). The paths
alternate call by call so load on the machine hits them alike; the best of ``--repeats`` is printed (on a shared
machine the median mostly measures the neighbours), in ms per layer, and the crossover M (first M where
dequantize + dense beats the kernel) per kind.

With ``--model``: one whole decode step (forward at context 128 + logits) of the real model loaded dense, int8 and
int4, per batch size, alternating step by step; best and median ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import machine as bench_machine
import torch
import torch.nn.functional as F
from model_step import interleaved_steps

from service.model.weights import Scratch, quantize

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w13": (3072, 576), "w2": (576, 1536)}


def paths(dtype: torch.dtype, m: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    dense = {n: (torch.randn(s, generator=gen) / s[1] ** 0.5).to(dtype) for n, s in SHAPES.items()}
    q8 = {n: quantize(w.float(), "int8", dtype=dtype) for n, w in dense.items()}
    q4 = {n: quantize(w.float(), "int4", 32, dtype=dtype) for n, w in dense.items()}
    xs = {n: torch.randn(m, s[1], generator=gen).to(dtype) for n, s in SHAPES.items()}
    scratch = Scratch()

    def run_dense() -> None:
        for n, w in dense.items():
            F.linear(xs[n], w)

    def kernel(qs: dict[str, object]) -> Callable[[], None]:
        return lambda: [qs[n].matmul(xs[n]) for n in SHAPES]  # type: ignore[attr-defined]

    def dequant(qs: dict[str, object]) -> Callable[[], None]:
        def run() -> None:
            for n in SHAPES:
                w = qs[n]
                F.linear(xs[n], w.dequantize(out=scratch.get(w.shape, dtype, w.device)))  # type: ignore[attr-defined]

        return run

    return {
        "dense": run_dense,
        "int8": kernel(q8),
        "int8+dq": dequant(q8),
        "int4": kernel(q4),
        "int4+dq": dequant(q4),
    }


def measure(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: min(v) * 1e3 for k, v in times.items()}


def model_steps(folder: str, dtype: torch.dtype, batch: int, steps: int) -> dict[str, list[float]]:
    from service.model import KVCache
    from service.model.load_folder import load_model

    context = 128
    runs = {}
    for kind in ("dense", "int8", "int4"):
        model, cfg, _ = load_model(folder, dtype=dtype, device="cpu", quantize=None if kind == "dense" else kind)  # type: ignore[arg-type]
        cache = KVCache(cfg, batch, context + steps + 2, dtype=dtype, device=model.device)
        cache.data.normal_(generator=torch.Generator().manual_seed(0))
        nxt = torch.randint(0, cfg.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(1))

        def step(i: int, model: object = model, cache: object = cache, nxt: torch.Tensor = nxt) -> object:
            pos = torch.full((batch, 1), context + i, dtype=torch.long)
            return model.logits(model(nxt, pos, cache, 0, kv_len=context + i + 1)[:, -1])  # type: ignore[attr-defined]

        runs[kind] = step
    return interleaved_steps(runs, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--model", help="time whole decode steps of this model instead of single layers")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per decode step, best / median")
        print("\n| dtype | batch | dense | int8 | int4 |\n|---|---|---|---|---|")
        for dt in args.dtype:
            for b in args.batch:
                t = model_steps(args.model, getattr(torch, dt), b, args.steps)
                cells = " | ".join(f"{min(v) * 1e3:.1f} / {statistics.median(v) * 1e3:.1f}" for v in t.values())
                print(f"| {dt} | {b} | {cells} |", flush=True)
        return
    print(
        f"{bench_machine.line()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"ms per layer (4 projections), best of {args.repeats}"
    )
    for dt in args.dtype:
        dtype = getattr(torch, dt)
        print(f"\n| {dt} M | dense | int8 | int8 dequant+dense | int4 g32 | int4 dequant+dense |")
        print("|---|---|---|---|---|---|")
        cross: dict[str, int | None] = {"int8": None, "int4": None}
        for m in args.rows:
            r = measure(paths(dtype, m), args.repeats)
            print(
                f"| {m} | " + " | ".join(f"{r[k]:.3f}" for k in ("dense", "int8", "int8+dq", "int4", "int4+dq")) + " |"
            )
            for kind in cross:
                if cross[kind] is None and r[f"{kind}+dq"] < r[kind]:
                    cross[kind] = m
        print(f"crossover (first M where dequantize + dense beats the kernel): {cross}")


if __name__ == "__main__":
    main()
