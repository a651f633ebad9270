"""loraplex's compiled kernels vs torch's eager paths on the default model's shapes, per row count, same run.

    .venv/bin/python bench/native_kernels.py [--rows 1 2 4 8 16 32 64] [--dtype float32] [--repeats 50]
                                             [--only dense decode]

Q4 projection 3072x576 (SmolLM2's ``w13``): ``Q4Native.matmul`` (the compiled kernel) vs torch's int4 kernel
(``Int4Weight.matmul``), vs dequantizing into a scratch buffer + dense matmul, vs a dense matmul over a kept copy.
Q8_0 head 49152x576: ``lp_q8_matmul`` vs the per-group int8 kernel (float32) / the int4 pair (bf16) and
dequantized chunks. Dense 3072x576 (eight copies taken in turn, 28-56 MB: read from memory as in a decode step, not
from the caches) and the dense head 49152x576: ``lp_dense_matmul`` vs ``F.linear`` (torch's GEMM), and in bf16 the
same eight weights and the head in pairs (``Bf16Pairs``, ``PairsTable``: ``lp_pairs_matmul``). Decode attention
(rows = batch rows at position 256): ``lp_decode_attention`` vs torch's SDPA over the same cache. Each cell:
median of ``--repeats`` calls after warm-up, in µs, the forms interleaved per row count so that other load hits all
alike. The variant is torch's capability's (``ATEN_CPU_CAPABILITY`` forces it). The thresholds in
``service/model/weights/q4_native.py``, ``q8_table.py`` and ``protocol.NATIVE_DENSE_ROWS`` come from this table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from service.kernels import native
from service.loading.gguf_blocks import Int8Rows
from service.model.weights import Int4Weight, Q8Table, Scratch, linear
from service.model.weights.bf16_pairs import Bf16Pairs, PairsTable
from service.model.weights.q4_native import Q4Native
from service.platform import cpu_capability


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def q4_forms(dtype: torch.dtype, kern: native.NativeKernels) -> dict[str, Callable[[torch.Tensor], object]]:
    gen = torch.Generator().manual_seed(0)
    n, k = 3072, 576
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()  # float16 values, as a GGUF stores them
    m = (torch.randn(n, k // 32, generator=gen) * 0.02).half().float()
    ours = Q4Native.from_q_d_m(q, d, m, kern, dtype=dtype)
    torch_int4 = Int4Weight.from_q_scale_zero(q, d, m + 8 * d, 32, dtype=dtype)
    copy = ours.dequantize(dtype)
    scratch = Scratch()
    return {
        "native": ours.matmul,
        "torch int4": torch_int4.matmul,
        "dequant+dense": lambda x: linear(x, ours.with_dispatch(1), scratch=scratch),
        "dense copy": lambda x: torch.nn.functional.linear(x, copy),
    }


def head_forms(dtype: torch.dtype, kern: native.NativeKernels) -> dict[str, Callable[[torch.Tensor], object]]:
    gen = torch.Generator().manual_seed(1)
    vocab, k = 49152, 576
    rows = Int8Rows.group_major(vocab, k)
    rows.q.copy_(torch.randint(-127, 128, rows.q.shape, generator=gen, dtype=torch.int8))
    rows.scale.copy_(torch.rand(vocab, k // 32, generator=gen) * 0.01)
    ours, eager = Q8Table(rows, dtype, kern), Q8Table(rows, dtype)
    eager.pair_for_head()
    return {"native": ours.project, eager.kernel_for(1).split(":")[0]: eager.project}


def dense_forms(dtype: torch.dtype, kern: native.NativeKernels) -> dict[str, Callable[[torch.Tensor], object]]:
    gen = torch.Generator().manual_seed(2)
    copies, turn = [torch.randn(3072, 576, generator=gen).to(dtype) for _ in range(8)], [0]
    pairs = [Bf16Pairs.pack(w, kern) for w in copies] if dtype == torch.bfloat16 else []

    def next_turn() -> int:
        turn[0] = (turn[0] + 1) % len(copies)
        return turn[0]

    forms: dict[str, Callable[[torch.Tensor], object]] = {
        "native": lambda x: kern.dense_matmul(x, copies[next_turn()], dtype),
        "torch": lambda x: torch.nn.functional.linear(x, copies[next_turn()]),
    }
    if pairs:  # bf16: the same weights in pairs (lp_pairs_matmul; the portable code where the CPU lacks bf16 dots)
        forms["pairs"] = lambda x: pairs[next_turn()].matmul(x)
    return forms


def dense_head_forms(dtype: torch.dtype, kern: native.NativeKernels) -> dict[str, Callable[[torch.Tensor], object]]:
    head = torch.randn(49152, 576, generator=torch.Generator().manual_seed(3)).to(dtype)
    forms: dict[str, Callable[[torch.Tensor], object]] = {
        "native": lambda x: kern.dense_matmul(x, head, torch.float32),
        "torch": lambda x: torch.nn.functional.linear(x, head),
    }
    if dtype == torch.bfloat16:  # the head in pairs (PairsTable): float32 logits
        forms["pairs"] = PairsTable(Bf16Pairs.pack(head, kern)).project
    return forms


def attention_forms(dtype: torch.dtype, kern: native.NativeKernels) -> dict[str, Callable[[torch.Tensor], object]]:
    """SmolLM2's decode attention (9 query heads on 3 KV heads of 64) at position 256 for x's rows: the compiled op
    (RoPE, the K/V write and softmax over the slot cache) vs torch's SDPA over the same cache (no RoPE, no write)."""
    heads, kv, d, length, at = 9, 3, 64, 512, 256
    made: dict[int, tuple[torch.Tensor, ...]] = {}

    def inputs(b: int) -> tuple[torch.Tensor, ...]:
        if b not in made:
            gen = torch.Generator().manual_seed(b)
            qkv = torch.randn(b, heads + 2 * kv, d, generator=gen).to(dtype)
            cos, sin = (torch.randn(b, d, generator=gen).to(dtype) for _ in range(2))
            k_cache, v_cache = (torch.randn(b, kv, length, d, generator=gen).to(dtype) for _ in range(2))
            made[b] = (qkv, cos, sin, torch.full((b,), at, dtype=torch.int64), k_cache, v_cache)
        return made[b]

    def ours(x: torch.Tensor) -> object:
        return kern.decode_attention(*inputs(x.shape[0]), heads)

    def eager(x: torch.Tensor) -> object:
        qkv, _, _, _, k_cache, v_cache = inputs(x.shape[0])
        q = qkv[:, :heads, None]  # [B, H, 1, D]
        k, v = (c[:, :, : at + 1].repeat_interleave(heads // kv, dim=1) for c in (k_cache, v_cache))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    return {"native": ours, "torch sdpa": eager}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--only", nargs="+", help="tables whose title starts with one of these (e.g. dense)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    kern = native.kernels()
    if kern is None:
        raise SystemExit(f"no native kernels: {native.status()}")
    dtype = getattr(torch, args.dtype)
    print(f"capability {cpu_capability()}, variant {kern.isa}, {torch.get_num_threads()} threads, {args.dtype}")
    tables = {
        "q4 projection 3072x576": q4_forms(dtype, kern),
        "Q8_0 head 49152x576": head_forms(dtype, kern),
        "dense projection 3072x576": dense_forms(dtype, kern),
        "dense head 49152x576": dense_head_forms(dtype, kern),
        "decode attention 9/3 heads at 256 positions": attention_forms(dtype, kern),
    }
    for title, forms in tables.items():
        if args.only and not any(title.startswith(prefix) for prefix in args.only):
            continue
        print(f"\n{title} (µs per call)\n{'rows':>5} " + " ".join(f"{name:>14}" for name in forms))
        for m in args.rows:
            x = torch.randn(m, 576).to(dtype)
            repeats = args.repeats if m <= 8 else max(5, args.repeats // 5)
            cells = [timed(lambda f=f, x=x: f(x), repeats) for f in forms.values()]
            print(f"{m:>5} " + " ".join(f"{c:>14.1f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
