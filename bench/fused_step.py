"""The fused step ops (``service/kernels/src/step.cpp``) vs the eager ops they replace: one decode step of the
default model, same process, same weights, same run.

    .venv/bin/python bench/fused_step.py [--weights gguf folder pairs] [--dtype float32 bfloat16] [--batch 1 8 32]
                                         [--context 128] [--repeats 30]

Per weight source (``gguf``: the Q4_1 GGUF, on the compiled Q4 kernels in float32 and torch's int4 kernel in
bfloat16; ``folder``: the dense safetensors; ``pairs``: the same, a bf16 model's projections in pairs,
``Bf16Pairs``, on the CPU's bf16 dot products where it has them), dtype and batch size, one model decodes
``--batch`` rows whose caches hold ``--context`` positions: a step is the forward pass of one token a row plus the
logits. Each cell is the median of ``--repeats`` steps (ms) with ``Llama.native`` on (fused) and off (eager), the
two interleaved step by step so other load hits both alike; the speed-up is their ratio. Threads: torch's default
(``--threads`` to set). The variant follows torch's capability (``ATEN_CPU_CAPABILITY`` forces it). Figures:
bench/README.md, "Native kernels".
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import line  # noqa: E402
from bench.model_step import interleaved_steps  # noqa: E402
from service.kernels import native  # noqa: E402
from service.model import KVCache, Llama  # noqa: E402
from service.model.load_folder import load_model  # noqa: E402
from service.model.load_gguf import load_gguf_model  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load(weights: str, dtype: torch.dtype) -> Llama:
    if weights == "gguf":
        return load_gguf_model(MODEL, GGUF, dtype=dtype)[0]
    return load_model(MODEL, dtype=dtype, device="cpu", pairs=weights == "pairs")[0]


def step_times(model: Llama, batch: int, context: int, repeats: int) -> dict[str, float]:
    """Median ms of a decode step with the fused ops and without, one step of each in turn."""
    ops = model.native
    cache = KVCache(model.cfg, batch, context + repeats + 1, dtype=model.dtype, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    cache.data.normal_(generator=gen)  # a context's worth of K/V (values do not change the cost of a step)
    nxt = torch.randint(0, model.cfg.vocab_size, (batch, 1), generator=gen)

    def stepper(on: bool) -> Callable[[int], object]:
        def step(i: int) -> object:
            model.native = ops if on else None
            pos = torch.full((batch, 1), context + i, dtype=torch.long)  # both write the same position in turn
            return model.logits(model(nxt, pos, cache, 0, kv_len=context + i + 1)[:, -1])

        return step

    try:
        times = interleaved_steps({"fused": stepper(True), "eager": stepper(False)}, repeats)
    finally:
        model.native = ops
    return {form: statistics.median(t) * 1e3 for form, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", nargs="+", default=["gguf", "folder"], choices=("gguf", "folder", "pairs"))
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native.kernels() is None:
        raise SystemExit(f"no native kernels: {native.status()}")
    print(f"{line()}; kernels {native.status()}; threads {torch.get_num_threads()}; context {args.context}; "
          f"median of {args.repeats} steps")  # fmt: skip
    print("| weights | dtype | batch | eager ms | fused ms | speed-up | fused tok/s |")
    print("|---|---|---|---|---|---|---|")
    for weights in args.weights:
        for dtype in args.dtype:
            model = load(weights, getattr(torch, dtype))
            if model.native is None:
                raise SystemExit("the model did not take the fused ops")
            for batch in args.batch:
                t = step_times(model, batch, args.context, args.repeats)
                print(f"| {weights} | {dtype} | {batch} | {t['eager']:.2f} | {t['fused']:.2f} | "
                      f"{t['eager'] / t['fused']:.2f}x | {batch * 1e3 / t['fused']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
