"""int4 group-wise weight-only projections: ``w = (q - 8) * scale + zero`` per group of input columns.

    Int4Weight.from_q_scale_zero(q, scale, zero, group_size, *, dtype=None) -> Int4Weight
        q uint8/int32 [N, K] in 0..15; scale, zero [N, K // group_size]; exact: nothing is rounded beyond casting
        scale and zero to ``dtype`` (default scale's dtype).
    Int4Weight.quantize(w [N, K], group_size=32, *, dtype=None) -> Int4Weight      asymmetric min/max per group

Constraints (a ``ValueError`` naming the one violated): ``N % 16 == 0`` and ``K % group_size == 0`` with
group_size in 32, 64, 128. Kernels: on CPU ``torch._weight_int4pack_mm_for_cpu`` (packed by
``_convert_weight_to_int4pack_for_cpu``), on CUDA ``torch._weight_int4pack_mm`` (packed by
``_convert_weight_to_int4pack``, inner-k tiles 8, bfloat16 only).

The packed form's memory layout is the kernel's private business and differs by CPU capability: ``dequantize`` and
``unpack`` read it through the layout ``int4_layout`` derives from the packer itself at first use, and so
reproduce exactly the values the kernel multiplies by (tests/model/test_quant.py checks it against the kernel itself).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from service.model.weights.dispatch import compute_dtype, dense_from_rows
from service.model.weights.int4_layout import Int4Layout, Packer, layout_for, pack_cpu
from service.model.weights.protocol import tensor_nbytes

__all__ = ["GROUP_SIZES", "Int4Weight"]

GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, eq=False)
class Int4Weight:
    """``w = (q - 8) * scale + zero`` per group of ``group_size`` input columns; q in 0..15 packed two per byte in
    the kernel's layout. ``scales_and_zeros`` [K / group, N, 2] in the compute dtype."""

    packed: Tensor  # CPU: [N, K / 2] uint8 (kernel layout); CUDA: [N / 8, K / (inner_k_tiles * 16), 32, 4] int32
    scales_and_zeros: Tensor  # [K / group, N, 2]
    group_size: int
    in_features: int
    dense_from_rows: int  # M from which ``linear`` runs dense (DENSE_FROM_ROWS; DENSE_COPY_FROM_ROWS with a copy)
    dense: Tensor | None = None  # the dequantized weight [N, K], kept by ``with_dense_copy``
    kind: ClassVar[str] = "int4"
    kernel_name: ClassVar[str] = "torch int4 kernel"

    @classmethod
    def from_q_scale_zero(
        cls, q: Tensor, scale: Tensor, zero: Tensor, group_size: int, *, dtype: torch.dtype | None = None
    ) -> Int4Weight:
        if q.dim() != 2 or q.dtype not in (torch.uint8, torch.int32):
            raise ValueError(f"q must be a 2-D uint8 or int32 tensor, got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        _check_shape(n, k, group_size)
        groups = (n, k // group_size)
        if tuple(scale.shape) != groups or tuple(zero.shape) != groups:
            raise ValueError(
                f"scale and zero must be {list(groups)} (rows, K / group_size), "
                f"got {tuple(scale.shape)} and {tuple(zero.shape)}"
            )
        if q.numel():
            lo, hi = (int(v) for v in torch.aminmax(q))
            if lo < 0 or hi > 15:
                raise ValueError(f"q values must be in 0..15, got {lo}..{hi}")
        dtype = compute_dtype(dtype, scale.dtype)
        packed = _packer(q.device)(q.to(torch.int32).contiguous())
        sz = torch.stack((scale.t(), zero.t()), dim=-1).to(device=q.device, dtype=dtype).contiguous()  # [K/g, N, 2]
        return cls(packed, sz, group_size, k, dense_from_rows("int4", dtype))

    @classmethod
    def quantize(cls, w: Tensor, group_size: int = 32, *, dtype: torch.dtype | None = None) -> Int4Weight:
        """Asymmetric min/max per group: scale = (max - min) / 15, q = round((w - min) / scale),
        zero = min + 8 scale."""
        if w.dim() != 2 or not w.dtype.is_floating_point:
            raise ValueError(f"w must be a 2-D floating tensor, got {w.dtype} {tuple(w.shape)}")
        n, k = w.shape
        _check_shape(n, k, group_size)
        g = w.float().reshape(n, k // group_size, group_size)  # [N, K/g, g]
        lo, hi = torch.aminmax(g, dim=2)  # [N, K/g]
        scale = (hi - lo) / 15.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.sub(g, lo[..., None]).div_(scale[..., None]).round_().clamp_(0, 15)  # one temporary, in place
        q32 = q.view(n, k).to(torch.int32)  # [N, K]
        del q
        return cls.from_q_scale_zero(q32, scale, lo + 8.0 * scale, group_size, dtype=compute_dtype(dtype, w.dtype))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.scales_and_zeros.shape[1], self.in_features)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return (
            self.packed.numel() * self.packed.element_size()
            + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()
            + tensor_nbytes(self.dense)
        )

    @property
    def layout(self) -> Int4Layout:
        """How the kernel's packer laid this weight's values out, derived from the packer (``int4_layout``)."""
        return layout_for(*self.shape, self.device, _packer(self.device))

    @property
    def dequantize_kernel(self) -> str:
        return f"{self.layout.form} unpack"

    def unpack(self) -> Tensor:
        """q [N, K] uint8 in 0..15: the packed values in row-major order."""
        return self.layout.unpack(self.packed, torch.empty(self.shape, dtype=torch.uint8, device=self.device))

    def dequantize(self, dtype: torch.dtype | None = None, *, out: Tensor | None = None) -> Tensor:
        """The dense weight [N, K] (into ``out`` when given), computed as the kernel does: (q - 8) * scale + zero
        in the compute dtype, then cast to ``dtype``."""
        n, k = self.shape
        g = self.group_size
        own = self.dtype
        dense = out if out is not None and out.dtype == own else torch.empty((n, k), dtype=own, device=self.device)
        dense3 = self.layout.unpack(self.packed, dense).view(n, k // g, g).sub_(8)  # [N, K/g, g]
        scale = self.scales_and_zeros[..., 0].t()[..., None]  # [N, K/g, 1]
        zero = self.scales_and_zeros[..., 1].t()[..., None]
        dense3.mul_(scale).add_(zero)
        if out is not None:
            return out if out is dense else out.copy_(dense)
        return dense if dtype in (None, own) else dense.to(dtype)

    def matmul(self, x2: Tensor) -> Tensor:
        """x2 [M, K] contiguous, compute dtype -> [M, N] by the int4 kernel."""
        if x2.device.type == "cuda":
            return torch._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        return torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)

    def with_dense_copy(self) -> Int4Weight:
        if self.dense is not None:
            return self
        rows = dense_from_rows(self.kind, self.dtype, copy=True)
        return dataclasses.replace(self, dense=self.dequantize(), dense_from_rows=rows)

    def with_dispatch(self, dense_from_rows: int, *, keep_dense: bool = True) -> Int4Weight:
        dense = self.dense if keep_dense else None
        return dataclasses.replace(self, dense_from_rows=dense_from_rows, dense=dense)

    def probe(self, rows: int, gen: torch.Generator) -> tuple[Int4Weight, Tensor]:
        n, k, g, dev = rows, self.shape[1], self.group_size, self.device
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.005).to(self.dtype)  # as the weight stores them
        zero = (torch.randn(n, k // g, generator=gen) * 0.02).to(self.dtype)
        probe = Int4Weight.from_q_scale_zero(q.to(dev), scale.to(dev), zero.to(dev), g, dtype=self.dtype)
        truth = (q.float() - 8) * scale.float().repeat_interleave(g, 1) + zero.float().repeat_interleave(g, 1)
        return probe, truth.to(dev)


def _check_shape(n: int, k: int, group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size}")
    if n % 16:
        raise ValueError(f"int4 needs out_features divisible by 16, got {n}")
    if k % group_size:
        raise ValueError(f"int4 needs in_features divisible by group_size {group_size}, got {k}")


def _pack_cuda(q32: Tensor) -> Tensor:
    """The CUDA kernel's packer (inner-k tiles 8) of q int32 [N, K]: its [N, K / 2] uint8 input has q[2i] in the
    high nibble and q[2i+1] in the low (the op's documented input)."""
    return torch._convert_weight_to_int4pack((q32[:, ::2] << 4 | q32[:, 1::2]).to(torch.uint8), 8)


def _packer(device: torch.device) -> Packer:
    return _pack_cuda if device.type == "cuda" else pack_cpu
