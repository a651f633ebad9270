"""The wrappers of ``src/blocks.cpp``'s entry points, a base of ``service.kernels.native.NativeKernels``: the Q4 and
Q8_0 products, and the argmax of a Q8_0 head's logits screened in int8 (``q8_top``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from service.kernels.checks import DTYPE_CODES as _DTYPE_CODES
from service.kernels.checks import check_q4 as _check
from service.kernels.checks import check_q8 as _check_q8
from service.kernels.checks import raise_for as _raise

__all__ = ["BlockProducts", "q8_lanes"]


def q8_lanes(q: Tensor) -> Tensor:
    """A group-major Q8_0 table's values q [G, V, 32] int8 -> the copy ``q8_top`` screens with, [G, V // 16, 8, 16,
    4] uint8 holding q + 128: for group g and block b of 16 rows, slice j is bytes 4 j .. 4 j + 3 of each of the 16
    rows (``lp_q8_top`` in src/blocks.cpp). Built a group at a time: no temporary the size of the table."""
    groups, vocab, _ = q.shape
    blocks = vocab // 16
    out = torch.empty(groups, blocks, 8, 16, 4, dtype=torch.uint8)
    for g in range(groups):
        lanes = q[g, : blocks * 16].reshape(blocks, 16, 8, 4).transpose(1, 2)  # [blocks, 8, 16, 4]
        out[g].copy_(lanes.view(torch.uint8)).bitwise_xor_(0x80)
    return out


class BlockProducts:
    """The products over GGUF-style blocks; ``_lib`` is the loaded library (``NativeKernels``)."""

    _lib: Any
    q8_screen: bool  # lp_q8_top can screen on this CPU

    def q4_matmul(self, x2: Tensor, qs: Tensor, d: Tensor, m: Tensor, n: int, out_dtype: torch.dtype) -> Tensor:
        """x2 [M, K] -> [M, N] in ``out_dtype``: ``x2 @ W^T`` with ``W[n, 32 g + j] = d[n, g] q + m[n, g]``, in tiles
        of 16 rows (``Q4_TILE``; N rounded up): qs [tiles, K / 32, 16, 16] uint8, byte (t, g, p, i) holding row
        16 t + i's q at input 32 g + 2 p (low nibble) and 32 g + 2 p + 1 (high); d and m [tiles, K / 32, 16]
        float32."""
        mrows, k = x2.shape
        _check(x2, qs, d, m, k=k, n=n)
        out = torch.empty(mrows, n, dtype=out_dtype)
        rc = self._lib.lp_q4_matmul(x2.data_ptr(), _DTYPE_CODES[x2.dtype], qs.data_ptr(), d.data_ptr(), m.data_ptr(),
                                    mrows, n, k, out.data_ptr(), _DTYPE_CODES[out_dtype], n)  # fmt: skip
        if rc:
            _raise(rc, f"lp_q4_matmul refused x {tuple(x2.shape)} and weight [{n}, {k}]")
        return out

    def q8_matmul(self, x2: Tensor, q: Tensor, d: Tensor, out_dtype: torch.dtype) -> Tensor:
        """x2 [M, K] -> [M, V]: ``x2 @ T^T`` for a group-major Q8_0 table, q [K / 32, V, 32] int8, d [K / 32, V]
        (float32, bfloat16 or float16): ``T[v, 32 g + j] = d[g, v] q[g, v, j]``."""
        _check_q8(x2, q, d)
        (mrows, k), vocab = x2.shape, q.shape[1]
        out = torch.empty(mrows, vocab, dtype=out_dtype)
        rc = self._lib.lp_q8_matmul(x2.data_ptr(), _DTYPE_CODES[x2.dtype], q.data_ptr(), d.data_ptr(),
                                    _DTYPE_CODES[d.dtype], mrows, vocab, k, out.data_ptr(), _DTYPE_CODES[out_dtype],
                                    vocab)  # fmt: skip
        if rc:
            _raise(rc, f"lp_q8_matmul refused x {tuple(x2.shape)} and table [{vocab}, {k}]")
        return out

    def q8_top(
        self, x2: Tensor, q: Tensor, qs: Tensor, d: Tensor, c: Tensor, cap: int, scratch: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The largest of ``q8_matmul(x2, q, d, float32)``'s logits in each row and its first index, computing only
        the logits that an int8 screen cannot rule out (``lp_q8_top`` in src/blocks.cpp says how, and why the result
        is the full product's): x2 [M, K], the table as ``q8_matmul``'s, qs its copy for the screen
        (``q8_lanes(q)``), c [K / 32, V] float32 at least ``|d| * ||q||_2`` of each group.

        Returns (values [M] float32, indices [M] int64, found [M] int32): found[r] is the number of logits computed
        for row r, 0 where that row was not screened (a non-finite value, a row far larger than the others, more
        than ``cap`` candidates) and its value and index are undefined. ``scratch``: float32, M * V elements or
        more, reused across calls (a fresh one each call pays its page faults). Only where ``q8_screen``."""
        _check_q8(x2, q, d)
        (mrows, k), vocab = x2.shape, q.shape[1]
        if c.dtype != torch.float32 or tuple(c.shape) != tuple(d.shape) or not c.is_contiguous() or cap < 1:
            raise ValueError(f"q8_top: bounds c {c.dtype} {tuple(c.shape)} for d {tuple(d.shape)}, cap {cap}")
        lanes = (q.shape[0], q.shape[1] // 16, 8, 16, 4)
        if qs.dtype != torch.uint8 or tuple(qs.shape) != lanes or not qs.is_contiguous():
            raise ValueError(f"q8_top: screen copy {qs.dtype} {tuple(qs.shape)}, expected uint8 {lanes}")
        if scratch is None:
            scratch = torch.empty(mrows * vocab, dtype=torch.float32)
        elif scratch.dtype != torch.float32 or scratch.numel() < mrows * vocab or not scratch.is_contiguous():
            raise ValueError(f"q8_top: scratch {scratch.dtype} of {scratch.numel()} for {mrows} x {vocab} float32")
        values, indices = torch.empty(mrows, dtype=torch.float32), torch.empty(mrows, dtype=torch.int64)
        found = torch.zeros(mrows, dtype=torch.int32)
        rc = self._lib.lp_q8_top(x2.data_ptr(), _DTYPE_CODES[x2.dtype], q.data_ptr(), qs.data_ptr(), d.data_ptr(),
                                 _DTYPE_CODES[d.dtype], c.data_ptr(), mrows, vocab, k, cap, scratch.data_ptr(),
                                 values.data_ptr(), indices.data_ptr(), found.data_ptr())  # fmt: skip
        if rc:
            _raise(rc, f"lp_q8_top refused x {tuple(x2.shape)} and table [{vocab}, {k}]")
        return values, indices, found
