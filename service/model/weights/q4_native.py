"""GGUF-style 4-bit projections multiplied by loraplex's own kernel: ``Q4Native``, ``w = d * q + m`` per 32 columns.

    Q4Native.from_q_scale_zero(q, scale, zero, kernels) -> Q4Native
        q uint8/int32 [N, K] in 0..15; scale, zero [N, K / 32] in ``Int4Rows``' terms (``w = (q - 8) scale + zero``,
        so d = scale and m = zero - 8 scale, in float32)
    Q4Native.from_q_d_m(q, d, m, kernels) -> Q4Native                GGUF Q4_1's own terms

Kept as Q4_1 stores it: per row and group of 32, 16 bytes of nibble pairs (byte j: q[j] low, q[j + 16] high) and
float32 d and m (float16 in the file; converting them in the kernel measured no faster: the products are bound by
compute, not by bandwidth). ``matmul`` runs ``service.kernels.native``'s ``lp_q4_matmul``: float32 products and
accumulation over exact inputs, the output rounded once to the activations' dtype. Served for float32 compute
(torch's int4 kernel is ~20x slower there; in bfloat16 it is faster than this one, so bf16 keeps ``Int4Weight``).
CPU only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from service.kernels.native import NativeKernels
from service.model.weights.protocol import tensor_nbytes

__all__ = ["Q4_DENSE_COPY_FROM_ROWS", "Q4_DENSE_FROM_ROWS", "Q4Native"]

GROUP = 32
# Rows from which a dense matmul beats the kernel in float32 (bench/README.md, "Native kernels"): over a kept dense
# copy, and after dequantizing into the scratch buffer (~0.8 ms per 3072x576 projection).
Q4_DENSE_COPY_FROM_ROWS = 16
Q4_DENSE_FROM_ROWS = 64


@dataclass(frozen=True, eq=False)
class Q4Native:
    """``w = d * q + m`` per group of 32 input columns; ``qs`` [N, K / 2] uint8 nibble pairs, ``d``, ``m`` [N, K / 32]
    float32; ``dtype`` the compute dtype (the activations' and the output's)."""

    qs: Tensor
    d: Tensor
    m: Tensor
    dtype: torch.dtype
    kernels: NativeKernels
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
        q3 = q.view(n, k // GROUP, GROUP).to(torch.uint8)
        qs = (q3[..., :16] | (q3[..., 16:] << 4)).reshape(n, k // 2).contiguous()
        d, m = (t.to(torch.float32, copy=True).contiguous() for t in (d, m))  # never the caller's (reused) buffers
        return cls(qs, d, m, dtype, kernels)

    @classmethod
    def from_q_scale_zero(cls, q: Tensor, scale: Tensor, zero: Tensor, kernels: NativeKernels, *,
                          dtype: torch.dtype) -> Q4Native:  # fmt: skip
        d = scale.float()
        return cls.from_q_d_m(q, d, zero.float() - 8 * d, kernels, dtype=dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qs.shape[0], self.qs.shape[1] * 2)

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
        pairs = self.qs.view(n, k // GROUP, 16)
        return torch.stack((pairs & 15, pairs >> 4), dim=2).view(n, k)

    def dequantize(self, dtype: torch.dtype | None = None, *, out: Tensor | None = None) -> Tensor:
        """The dense weight [N, K] (into ``out`` when given): ``d * q + m`` in float32, then cast."""
        n, k = self.shape
        into = out if out is not None and out.dtype == torch.float32 else torch.empty(n, k)
        w3 = into.view(n, k // GROUP, GROUP).copy_(self.unpack().view(n, k // GROUP, GROUP))
        w = w3.mul_(self.d[..., None]).add_(self.m[..., None]).view(n, k)
        if out is not None:
            return out if out is into else out.copy_(w)
        return w.to(dtype or self.dtype)

    def matmul(self, x2: Tensor) -> Tensor:
        """x2 [M, K] contiguous, compute dtype -> [M, N] by the native kernel."""
        return self.kernels.q4_matmul(x2, self.qs, self.d, self.m, x2.dtype)

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
