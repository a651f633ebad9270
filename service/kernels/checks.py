"""Argument checks shared by ``service.kernels.native``'s wrappers, and the library's dtype codes."""

from __future__ import annotations

import torch
from torch import Tensor

from service.kernels import KERNEL_DTYPES

__all__ = [
    "DTYPE_CODES",
    "Q4_TILE",
    "check_attention",
    "check_pairs",
    "check_q4",
    "check_q8",
    "check_step",
    "check_tree",
    "raise_for",
    "tree_args",
]

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # src/*.cpp's Dtype
Q4_TILE = 16  # weight rows side by side in lp_q4_matmul's layout


def raise_for(rc: int, what: str) -> None:
    if rc == -2:
        raise MemoryError(f"{what}: no memory for its float32 scratch")
    raise ValueError(what)


def _contiguous_cpu(*tensors: Tensor) -> None:
    if any(not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        raise ValueError("native kernels take contiguous CPU tensors")


def check_q4(x2: Tensor, qs: Tensor, d: Tensor, m: Tensor, *, k: int, n: int) -> None:
    scales = (-(-n // Q4_TILE), k // 32, Q4_TILE)  # [tiles, G, 16]; qs [tiles, G, 16 pairs, 16]
    if k % 32 or x2.dtype not in DTYPE_CODES:
        raise ValueError(f"x must be [M, K] with K % 32 == 0 in {tuple(DTYPE_CODES)}, got {x2.dtype} {list(x2.shape)}")
    if tuple(qs.shape) != (*scales[:2], 16, Q4_TILE) or qs.dtype != torch.uint8:
        raise ValueError(f"packed values must be uint8 {[*scales[:2], 16, Q4_TILE]}, got {qs.dtype} {tuple(qs.shape)}")
    for t in (d, m):
        if tuple(t.shape) != scales or t.dtype != torch.float32:
            raise ValueError(f"scales must be float32 {list(scales)}, got {t.dtype} {tuple(t.shape)}")
    _contiguous_cpu(x2, qs, d, m)


def check_step(*tensors: Tensor) -> int:
    """The step ops' dtype code of ``tensors``, which must be contiguous CPU tensors of one of ``KERNEL_DTYPES``."""
    for t in tensors:
        if t.dtype not in KERNEL_DTYPES or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"native step ops take contiguous float32 / bfloat16 CPU tensors, got {t.dtype} "
                             f"{tuple(t.shape)}")  # fmt: skip
        if t.dtype != tensors[0].dtype:
            raise ValueError(f"native step ops take one dtype, got {tensors[0].dtype} and {t.dtype}")
    return DTYPE_CODES[tensors[0].dtype]


def check_pairs(x2: Tensor, w: Tensor, n: int, out_dtype: torch.dtype) -> None:
    """x2 [M, K] bf16 and a bf16 weight [N, K] in pairs, w [ceil(N / 16), ceil(K / 2), 16, 2]; contiguous, CPU."""
    check_step(x2)
    k = x2.shape[1] if x2.dim() == 2 else 0
    pairs = (-(-n // 16), -(-k // 2), 16, 2)
    if x2.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or tuple(w.shape) != pairs or k < 1:
        raise ValueError(f"pairs_matmul: x {x2.dtype} {list(x2.shape)}, w {w.dtype} {list(w.shape)} for {n} rows")
    if out_dtype not in KERNEL_DTYPES or not w.is_contiguous() or w.device.type != "cpu":
        raise ValueError(f"pairs_matmul: w must be a contiguous CPU tensor and out float32 / bf16, got {out_dtype}")


def check_q8(x2: Tensor, q: Tensor, d: Tensor) -> None:
    """x2 [M, K] and a group-major Q8_0 table q [K / 32, V, 32] int8, d [K / 32, V]; contiguous, CPU."""
    groups, vocab, group = q.shape
    if group != 32 or groups * 32 != x2.shape[1] or q.dtype != torch.int8 or tuple(d.shape) != (groups, vocab):
        raise ValueError(f"q8 table q {tuple(q.shape)} {q.dtype}, d {tuple(d.shape)} do not fit x {list(x2.shape)}")
    _contiguous_cpu(x2, q, d)


def check_tree(tree: Tensor | None, slots: int, tokens: int) -> None:
    """A draft tree's mask for ``slots`` rows of ``tokens`` nodes: bool [1 or slots, T, T], contiguous, on the CPU,
    every node seeing itself (the kernel checks the nodes' positions)."""
    if tree is None:
        return
    shape_ok = tree.dim() == 3 and tree.shape[0] in (1, slots) and tuple(tree.shape[1:]) == (tokens, tokens)
    if not shape_ok or tree.dtype != torch.bool or not tree.is_contiguous() or tree.device.type != "cpu":
        raise ValueError(f"a draft tree's mask must be contiguous CPU bool [1 or {slots}, {tokens}, {tokens}], got "
                         f"{tree.dtype} {tuple(tree.shape)}")  # fmt: skip
    if not bool(tree.diagonal(dim1=1, dim2=2).all()):
        raise ValueError("a draft tree's mask must let every node see itself")


def tree_args(tree: Tensor | None) -> tuple[int | None, int]:
    """The kernels' (address, stride between slots) of a checked tree mask: one byte a mark; stride 0 for one tree
    shared by every slot; (None, 0) for none."""
    if tree is None:
        return None, 0
    return tree.data_ptr(), 0 if tree.shape[0] == 1 else tree.stride(0)


def check_attention(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    pos: Tensor,
    caches: tuple[Tensor, Tensor],
    heads: int,
    slots: int,
    tree: Tensor | None = None,
) -> int:
    """decode_attention's arguments (see there); the dtype code."""
    (b, width, d), (k_cache, v_cache) = qkv.shape, caches
    kv, max_len = k_cache.shape[1], k_cache.shape[2]
    code = check_step(qkv, cos, sin)
    if width != heads + 2 * kv or tuple(cos.shape) != (b, d) or tuple(sin.shape) != (b, d):
        raise ValueError(f"decode_attention: qkv {tuple(qkv.shape)} for {heads} heads, cos {tuple(cos.shape)}")
    if slots < 0 or (b > 0 and (slots == 0 or b % slots != 0)):
        raise ValueError(f"decode_attention: {b} rows are not whole tokens of {slots} slots")
    check_tree(tree, slots, b // slots if slots else 0)
    if pos.dtype != torch.int64 or tuple(pos.shape) != (b,) or not pos.is_contiguous():
        raise ValueError(f"decode_attention: positions must be int64 [{b}], got {pos.dtype} {tuple(pos.shape)}")
    for c in (k_cache, v_cache):
        if c.dtype != qkv.dtype or c.shape != (slots, kv, max_len, d) or c.stride()[1:] != (max_len * d, d, 1):
            raise ValueError(f"decode_attention: a cache of {c.dtype} {tuple(c.shape)} {c.stride()}")
    if k_cache.stride(0) != v_cache.stride(0):
        raise ValueError("decode_attention: K and V caches of different strides")
    return code
