"""GGUF-style 4-bit projections multiplied by loraplex's own kernel: ``Q4Native``, ``w = d * q + m`` per 32 columns.

    Q4Native.from_q_scale_zero(q, scale, zero, kernels) -> Q4Native
        q uint8/int32 [N, K] in 0..15; scale, zero [N, K / 32] in ``Int4Rows``' terms (``w = (q - 8) scale + zero``,
        so d = scale and m = zero - 8 scale, in float32)
    Q4Native.from_q_d_m(q, d, m, kernels) -> Q4Native                GGUF Q4_1's own terms

Kept as tiles of 16 rows side by side (``lp_q4_matmul``'s layout, one accumulator lane a row): per tile and group
of 32 inputs, 16 bytes per pair of inputs (byte i: row i's two values, the even input in the low nibble) and
float32 d and m per row (float16 in the file). ``matmul`` runs ``service.kernels.native``'s ``lp_q4_matmul``:
float32 products and accumulation over exact inputs, the output rounded once to the activations' dtype, each row's
product bit-identical whatever the batch. Served for float32 compute (torch's int4 kernel is ~20x slower there; in
bfloat16 it is faster than this one, so bf16 keeps ``Int4Weight``).
CPU only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from service.kernels.native import Q4_TILE, NativeKernels
from service.model.weights.protocol import tensor_nbytes

__all__ = ["Q4_DENSE_COPY_FROM_ROWS", "Q4_DENSE_FROM_ROWS", "Q4Native"]

GROUP = 32
# Rows from which a dense matmul beats the kernel in float32 (bench/README.md, "The products at 16-32 rows"): over
# a kept dense copy, and after dequantizing into the scratch buffer (~1.5 ms per 3072x576 projection). A prefill of
# 32 short prompts (~400 rows) is near the crossing: the kernel wins below ~256 rows on 3072x576, ~200 on 576x1536.
Q4_DENSE_COPY_FROM_ROWS = 64
Q4_DENSE_FROM_ROWS = 256


@dataclass(frozen=True, eq=False)
class Q4Native:
    """``w = d * q + m`` per group of 32 input columns, in ``lp_q4_matmul``'s tiles of 16 rows: ``qs`` [tiles, K / 32,
    16, 16] uint8 nibble pairs, ``d``, ``m`` [tiles, K / 32, 16] float32; ``dtype`` the compute dtype (the
    activations' and the output's)."""

    qs: Tensor
    d: Tensor
    m: Tensor
    dtype: torch.dtype
    kernels: NativeKernels
    rows: int  # N (the last tile's lanes past it are zeros)
    dense_from_rows: int = Q4_DENSE_FROM_ROWS
    dense: Tensor | None = None  # the dequantized weight [N, K], kept by ``with_dense_copy``
    kind: ClassVar[str] = "q4"
    dequantize_kernel: ClassVar[str] = "nibble unpack"

    @classmethod
    def from_q_d_m(cls, q: Tensor, d: Tensor, m: Tensor, kernels: NativeKernels, *, dtype: torch.dtype) -> Q4Native:
        if q.dim() != 2 or q.dtype not in (torch.uint8, torch.int32) or q.shape[1] % GROUP:
            raise ValueError(f"q must be 2-D uint8 / int32 [N, K], K % {GROUP} == 0, got {q.dtype} {list(q.shape)}")
        n, k = q.shape
        groups = (n, k // GROUP)
        if tuple(d.shape) != groups or tuple(m.shape) != groups:
            raise ValueError(f"d and m must be {list(groups)}, got {tuple(d.shape)} and {tuple(m.shape)}")
        if q.numel():
            lo, hi = (int(v) for v in torch.aminmax(q))
            if lo < 0 or hi > 15:
                raise ValueError(f"q values must be in 0..15, got {lo}..{hi}")
        tiles = -(-n // Q4_TILE)
        q4 = F.pad(q.to(torch.uint8), (0, 0, 0, tiles * Q4_TILE - n)).view(tiles, Q4_TILE, k // GROUP, GROUP // 2, 2)
        qs = (q4[..., 0] | (q4[..., 1] << 4)).permute(0, 2, 3, 1).contiguous()  # [tiles, G, 16 pairs, 16 rows]
        d, m = (_tiled(t.to(torch.float32), tiles) for t in (d, m))
        return cls(qs, d, m, dtype, kernels, n)

    @classmethod
    def from_q_scale_zero(cls, q: Tensor, scale: Tensor, zero: Tensor, kernels: NativeKernels, *,
                          dtype: torch.dtype) -> Q4Native:  # fmt: skip
        d = scale.float()
        return cls.from_q_d_m(q, d, zero.float() - 8 * d, kernels, dtype=dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.qs.shape[1] * GROUP)

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qs) + tensor_nbytes(self.d) + tensor_nbytes(self.m) + tensor_nbytes(self.dense)

    @property
    def kernel_name(self) -> str:
        return f"{self.kernels.name} q4 kernel"

    def unpack(self) -> Tensor:
        """q [N, K] uint8 in 0..15 in row-major order."""
        n, k = self.shape
        pairs = self.qs.permute(0, 3, 1, 2)  # [tiles, 16 rows, G, 16 pairs]
        return torch.stack((pairs & 15, pairs >> 4), dim=-1).reshape(-1, k)[:n]

    def dequantize(self, dtype: torch.dtype | None = None, *, out: Tensor | None = None) -> Tensor:
        """The dense weight [N, K] (into ``out`` when given): ``d * q + m`` in float32, then cast."""
        n, k = self.shape
        into = out if out is not None and out.dtype == torch.float32 else torch.empty(n, k)
        w3 = into.view(n, k // GROUP, GROUP).copy_(self.unpack().view(n, k // GROUP, GROUP))
        w = w3.mul_(_rows(self.d, n)[..., None]).add_(_rows(self.m, n)[..., None]).view(n, k)
        if out is not None:
            return out if out is into else out.copy_(w)
        return w.to(dtype or self.dtype)

    def matmul(self, x2: Tensor) -> Tensor:
        """x2 [M, K] contiguous, compute dtype -> [M, N] by the native kernel."""
        return self.kernels.q4_matmul(x2, self.qs, self.d, self.m, self.rows, x2.dtype)

    def with_dense_copy(self) -> Q4Native:
        if self.dense is not None:
            return self
        return dataclasses.replace(self, dense=self.dequantize(), dense_from_rows=Q4_DENSE_COPY_FROM_ROWS)

    def with_dispatch(self, dense_from_rows: int, *, keep_dense: bool = True) -> Q4Native:
        return dataclasses.replace(self, dense_from_rows=dense_from_rows, dense=self.dense if keep_dense else None)

    def probe(self, rows: int, gen: torch.Generator) -> tuple[Q4Native, Tensor]:
        k = self.shape[1]
        q = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.int32)
        d = torch.rand(rows, k // GROUP, generator=gen) * 0.02 + 0.005
        m = torch.randn(rows, k // GROUP, generator=gen) * 0.02
        probe = Q4Native.from_q_d_m(q, d, m, self.kernels, dtype=self.dtype)
        truth = q.double() * d.double().repeat_interleave(GROUP, 1) + m.double().repeat_interleave(GROUP, 1)
        return probe, truth.float()


def _tiled(per_row: Tensor, tiles: int) -> Tensor:
    """[N, G] per-row scales -> [tiles, G, 16], rows past N zero (a fresh tensor: never the caller's buffer)."""
    n, groups = per_row.shape
    return F.pad(per_row, (0, 0, 0, tiles * Q4_TILE - n)).view(tiles, Q4_TILE, groups).transpose(1, 2).contiguous()


def _rows(tiled: Tensor, n: int) -> Tensor:
    """``_tiled``'s inverse: [tiles, G, 16] -> [N, G]."""
    return tiled.transpose(1, 2).reshape(-1, tiled.shape[1])[:n]
