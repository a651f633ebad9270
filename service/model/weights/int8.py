"""int8 weight-only projections: one scale per output row, multiplied by ``torch._weight_int8pack_mm``.

    Int8Weight.from_q_scale(q int8 [N, K], scale [N], *, dtype=None) -> Int8Weight   w = q * scale
    Int8Weight.quantize(w [N, K], *, dtype=None) -> Int8Weight                     symmetric absmax per row

The same kernel serves CPU and CUDA. ``dequantize`` is exactly ``q * scale`` in the compute dtype, what the kernel
multiplies by (tests/model/test_quant.py checks it against the kernel itself).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from service.model.weights.dispatch import compute_dtype, dense_from_rows
from service.model.weights.protocol import tensor_nbytes

__all__ = ["Int8Weight"]


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """``w = q * scale``: int8 values, one scale per output row. ``q`` [N, K] int8, ``scale`` [N] in ``dtype``."""

    q: Tensor  # [N, K] int8
    scale: Tensor  # [N], compute dtype
    dense_from_rows: int  # M from which ``linear`` runs dense (DENSE_FROM_ROWS; DENSE_COPY_FROM_ROWS with a copy)
    dense: Tensor | None = None  # the dequantized weight [N, K], kept by ``with_dense_copy``
    kind: ClassVar[str] = "int8"
    kernel_name: ClassVar[str] = "torch int8 kernel"
    dequantize_kernel: ClassVar[str] = "dequantize"

    @classmethod
    def from_q_scale(cls, q: Tensor, scale: Tensor, *, dtype: torch.dtype | None = None) -> Int8Weight:
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"q must be a 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
        if tuple(scale.shape) != (q.shape[0],):
            raise ValueError(f"scale must be [{q.shape[0]}] (one per output row), got {tuple(scale.shape)}")
        dtype = compute_dtype(dtype, scale.dtype)
        scale = scale.to(device=q.device, dtype=dtype).contiguous()
        return cls(q.contiguous(), scale, dense_from_rows("int8", dtype))

    @classmethod
    def quantize(cls, w: Tensor, *, dtype: torch.dtype | None = None) -> Int8Weight:
        """Symmetric per-row quantization: scale = max |w| / 127, q = round(w / scale)."""
        if w.dim() != 2 or not w.dtype.is_floating_point:
            raise ValueError(f"w must be a 2-D floating tensor, got {w.dtype} {tuple(w.shape)}")
        # One float temporary, worked in place: a streamed load quantizes 100+ projections, and every extra
        # projection-sized temporary is heap the allocator may never return.
        lo, hi = torch.aminmax(w, dim=1)  # [N] each
        scale = torch.maximum(hi.float(), lo.float().neg()) / 127.0  # [N]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.div(w.float(), scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # [N, K]
        return cls.from_q_scale(q, scale, dtype=compute_dtype(dtype, w.dtype))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size() + tensor_nbytes(self.dense)

    def dequantize(self, dtype: torch.dtype | None = None, *, out: Tensor | None = None) -> Tensor:
        """The dense weight [N, K] (into ``out`` when given): exactly ``q * scale`` in ``dtype``."""
        dtype = self.dtype if dtype is None else dtype
        out = torch.empty(self.shape, dtype=dtype, device=self.device) if out is None else out
        out.copy_(self.q)
        return out.mul_(self.scale.to(dtype)[:, None])

    def matmul(self, x2: Tensor) -> Tensor:
        """x2 [M, K] contiguous, compute dtype -> [M, N] by the int8 kernel."""
        return torch._weight_int8pack_mm(x2, self.q, self.scale)

    def with_dense_copy(self) -> Int8Weight:
        if self.dense is not None:
            return self
        rows = dense_from_rows(self.kind, self.dtype, copy=True)
        return dataclasses.replace(self, dense=self.dequantize(), dense_from_rows=rows)

    def with_dispatch(self, dense_from_rows: int, *, keep_dense: bool = True) -> Int8Weight:
        dense = self.dense if keep_dense else None
        return dataclasses.replace(self, dense_from_rows=dense_from_rows, dense=dense)

    def probe(self, rows: int, gen: torch.Generator) -> tuple[Int8Weight, Tensor]:
        n, k = rows, self.shape[1]
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(self.dtype)
        probe = Int8Weight.from_q_scale(q.to(self.device), scale.to(self.device), dtype=self.dtype)
        return probe, (q.float() * scale.float()[:, None]).to(self.device)
