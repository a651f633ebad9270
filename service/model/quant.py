"""Weight-only quantized projection weights (int8 per output channel, int4 group-wise) and the one ``linear``.

The API (the GGUF reader builds on it; shapes are ``N`` = out_features rows, ``K`` = in_features columns):

    Int4Weight.from_q_scale_zero(q, scale, zero, group_size, *, dtype=None) -> Int4Weight
        q uint8/int32 [N, K] in 0..15; scale, zero [N, K // group_size]; the weight is w = (q - 8) * scale + zero
        (exact: nothing is rounded beyond casting scale and zero to ``dtype``, default scale's dtype).
    Int4Weight.quantize(w [N, K], group_size=32, *, dtype=None) -> Int4Weight      asymmetric min/max per group
    Int8Weight.from_q_scale(q int8 [N, K], scale [N], *, dtype=None) -> Int8Weight   w = q * scale
    Int8Weight.quantize(w [N, K], *, dtype=None) -> Int8Weight                     symmetric absmax per row
    quantize(w, kind, group_size=32, *, dtype=None) -> QuantizedWeight   kind "int8" | "int4"
    weight.dequantize(dtype) -> Tensor [N, K];  weight.shape == (N, K);  weight.nbytes;  weight.dtype
    linear(x [..., K], w: Tensor | QuantizedWeight, bias=None, *, scratch=None) -> [..., N]
    with_dense_copy(w) -> QuantizedWeight   the same weight keeping its dequantized copy, for large batches
    keep_dense_copies(model, budget_bytes) -> int   dense copies of a model's compact weights, within a budget

``dtype`` is the compute dtype: the activations' dtype, which torch's kernels require the scales to share (float32,
bfloat16 or float16). Constraints (a ``ValueError`` naming the one violated): int4 needs ``N % 16 == 0`` and
``K % group_size == 0`` with group_size in 32, 64, 128.

Kernels: on CPU ``torch._weight_int4pack_mm_for_cpu`` (packed by ``_convert_weight_to_int4pack_for_cpu``) and
``torch._weight_int8pack_mm``; on CUDA ``torch._weight_int4pack_mm`` (packed by ``_convert_weight_to_int4pack``,
inner-k tiles 8, bfloat16 only) and the same int8 kernel. ``linear`` chooses by shape: below a weight's
``dense_from_rows`` rows it runs the quantized kernel; from there on (prefill, large batches) it dequantizes into a
caller-owned ``Scratch`` buffer (one per model, reused by every layer: never a second full copy of the weights) and
runs the dense matmul, which is then faster (measured: bench/README.md, "Quantized kernels"). A weight made by
``with_dense_copy`` (``--dense-copies-mb``: memory traded for speed at large batches) keeps its dequantized copy
and multiplies by it from ``DENSE_COPY_FROM_ROWS`` rows on, where the dense matmul beats the kernel without a
dequantize to pay for.

The packed form's memory layout is the kernel's private business and differs by CPU capability: ``dequantize`` and
``unpack`` read it through the layout ``service.model.int4_layout`` derives from the packer itself at first use.

Invariants: a weight holds its packed form and scales, plus a dense copy only when ``with_dense_copy`` made it
(counted in ``nbytes``); ``dequantize`` reproduces exactly the values the kernel multiplies by
(tests/model/test_quant.py checks it against the kernel itself), and the dense copy is that dequantized weight.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from service.model.int4_layout import Int4Layout, Packer, layout_for, pack_cpu
from service.platform import cpu_capability

if TYPE_CHECKING:
    from service.model.llama import Llama, ProjName

__all__ = [
    "DENSE_COPY_FROM_ROWS",
    "DENSE_FROM_ROWS",
    "GROUP_SIZES",
    "NEVER",
    "Int4Weight",
    "Int8Weight",
    "QuantKind",
    "QuantizedWeight",
    "Scratch",
    "dense_from_rows",
    "keep_dense_copies",
    "linear",
    "quantize",
    "tensor_nbytes",
    "with_dense_copy",
]

QuantKind = Literal["int8", "int4"]
GROUP_SIZES = (32, 64, 128)
# Rows (M = batch x tokens) from which dequantize-then-dense beats the quantized kernel on CPU, and (``_COPY``) from
# which a weight's kept dense copy (``with_dense_copy``) does, per torch CPU capability, kind and compute dtype.
# Measured with bench/quant_kernels.py on one Sapphire Rapids VM (bench/README.md, "Quantized kernels per
# capability"): AVX512 natively; AVX2 and DEFAULT with torch, oneDNN and MKL all held to that instruction set
# (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS): the kernels of such a CPU, not its memory.
# float16 (unmeasured) takes bfloat16's; an unlisted capability (aarch64's, POWER's) takes DEFAULT's; CUDA always
# uses the kernel. NEVER: the kernel wins at every measured M (emulated bf16 makes dense matmuls slow).
NEVER = sys.maxsize


def _table(f32: tuple[int, int], bf16: tuple[int, int]) -> dict[tuple[QuantKind, torch.dtype], int]:
    """(int8, int4) rows in float32 and in bfloat16 (and float16)."""
    rows: dict[tuple[QuantKind, torch.dtype], int] = {}
    for dtype, (int8, int4) in ((torch.float32, f32), (torch.bfloat16, bf16), (torch.float16, bf16)):
        rows["int8", dtype], rows["int4", dtype] = int8, int4
    return rows


DENSE_FROM_ROWS = {
    "AVX512": _table(f32=(1, 2), bf16=(32, 128)),
    "AVX2": _table(f32=(1, 1), bf16=(NEVER, NEVER)),
    "DEFAULT": _table(f32=(2, 2), bf16=(4, 8)),
}
DENSE_COPY_FROM_ROWS = {
    "AVX512": _table(f32=(1, 1), bf16=(8, 16)),
    "AVX2": _table(f32=(1, 1), bf16=(NEVER, NEVER)),
    "DEFAULT": _table(f32=(1, 1), bf16=(1, 1)),
}


def dense_from_rows(kind: QuantKind, dtype: torch.dtype, *, copy: bool = False) -> int:
    """Rows from which ``linear`` leaves ``kind``'s kernel for a dense matmul on this CPU (``copy``: over a kept
    dense copy; else dequantizing into the scratch buffer)."""
    table = DENSE_COPY_FROM_ROWS if copy else DENSE_FROM_ROWS
    return table.get(cpu_capability(), table["DEFAULT"])[kind, dtype]


_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Scratch:
    """A reusable flat buffer that dense weights are materialised into, one projection at a time.

    One per model (the engine thread is its only user); it grows to the largest projection and stays there.
    """

    def __init__(self) -> None:
        self._buf: Tensor | None = None

    def get(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Tensor:
        n = shape[0] * shape[1]
        buf = self._buf
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(n, 0 if buf is None else buf.numel()), dtype=dtype, device=device)
            self._buf = buf
        return buf[:n].view(shape)

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()


def _compute_dtype(dtype: torch.dtype | None, fallback: torch.dtype) -> torch.dtype:
    dtype = fallback if dtype is None else dtype
    if dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {_COMPUTE_DTYPES}, got {dtype}")
    return dtype


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """``w = q * scale``: int8 values, one scale per output row. ``q`` [N, K] int8, ``scale`` [N] in ``dtype``."""

    q: Tensor  # [N, K] int8
    scale: Tensor  # [N], compute dtype
    dense_from_rows: int  # M from which ``linear`` runs dense (DENSE_FROM_ROWS; DENSE_COPY_FROM_ROWS with a copy)
    dense: Tensor | None = None  # the dequantized weight [N, K], kept by ``with_dense_copy``
    kind: ClassVar[QuantKind] = "int8"

    @classmethod
    def from_q_scale(cls, q: Tensor, scale: Tensor, *, dtype: torch.dtype | None = None) -> Int8Weight:
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"q must be a 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
        if tuple(scale.shape) != (q.shape[0],):
            raise ValueError(f"scale must be [{q.shape[0]}] (one per output row), got {tuple(scale.shape)}")
        dtype = _compute_dtype(dtype, scale.dtype)
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
        return cls.from_q_scale(q, scale, dtype=_compute_dtype(dtype, w.dtype))

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
    kind: ClassVar[QuantKind] = "int4"

    @classmethod
    def from_q_scale_zero(
        cls, q: Tensor, scale: Tensor, zero: Tensor, group_size: int, *, dtype: torch.dtype | None = None
    ) -> Int4Weight:
        if q.dim() != 2 or q.dtype not in (torch.uint8, torch.int32):
            raise ValueError(f"q must be a 2-D uint8 or int32 tensor, got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        _check_int4_shape(n, k, group_size)
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
        dtype = _compute_dtype(dtype, scale.dtype)
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
        _check_int4_shape(n, k, group_size)
        g = w.float().reshape(n, k // group_size, group_size)  # [N, K/g, g]
        lo, hi = torch.aminmax(g, dim=2)  # [N, K/g]
        scale = (hi - lo) / 15.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.sub(g, lo[..., None]).div_(scale[..., None]).round_().clamp_(0, 15)  # one temporary, in place
        q32 = q.view(n, k).to(torch.int32)  # [N, K]
        del q
        return cls.from_q_scale_zero(q32, scale, lo + 8.0 * scale, group_size, dtype=_compute_dtype(dtype, w.dtype))

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


QuantizedWeight = Int8Weight | Int4Weight


def tensor_nbytes(t: Tensor | None) -> int:
    """Bytes of ``t``'s elements (0 for None)."""
    return 0 if t is None else t.numel() * t.element_size()


def with_dense_copy(w: QuantizedWeight) -> QuantizedWeight:
    """``w`` keeping its dequantized weight, which ``linear`` multiplies by from ``DENSE_COPY_FROM_ROWS`` rows on:
    the kernel's speed at small batches, the dense matmul's at large ones, for the memory of both."""
    if w.dense is not None:
        return w
    rows = dense_from_rows(w.kind, w.dtype, copy=True)
    return dataclasses.replace(w, dense=w.dequantize(), dense_from_rows=rows)


def keep_dense_copies(model: Llama, budget_bytes: int | None) -> int:
    """Keep dense copies of ``model``'s compact weights while they fit in ``budget_bytes`` (None: all), for large
    batches (``with_dense_copy``; a compact head's ``keep_dense``): the head first, the slowest at large batches
    without one, then the projections layer by layer. Returns the bytes added."""
    left = budget_bytes
    added = 0
    head = model.lm_head
    if not isinstance(head, Tensor):
        size = model.cfg.vocab_size * model.cfg.hidden_size * model.dtype.itemsize
        if left is None or size <= left:
            added += head.keep_dense()
            left = None if left is None else left - size
    if not model.quantized:
        return added
    for layer in range(model.cfg.num_layers):
        names: tuple[ProjName, ...] = ("wqkv", "wo", "w13", "w2")  # llama.PROJ_NAMES (that module imports this one)
        for name in names:
            w = model.projection(layer, name)
            if isinstance(w, Tensor) or w.dense is not None:
                continue
            size = w.shape[0] * w.shape[1] * w.dtype.itemsize
            if left is not None and size > left:
                return added
            model.set_projection(layer, name, with_dense_copy(w))
            added += size
            left = None if left is None else left - size
    return added


def _check_int4_shape(n: int, k: int, group_size: int) -> None:
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


def quantize(w: Tensor, kind: QuantKind, group_size: int = 32, *, dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Quantize a dense [N, K] weight (see the classes' ``quantize``)."""
    if kind == "int8":
        return Int8Weight.quantize(w, dtype=dtype)
    if kind == "int4":
        return Int4Weight.quantize(w, group_size, dtype=dtype)
    raise ValueError(f"quantization kind must be 'int8' or 'int4', got {kind!r}")


def linear(
    x: Tensor, w: Tensor | QuantizedWeight, bias: Tensor | None = None, *, scratch: Scratch | None = None
) -> Tensor:
    """``F.linear(x, w, bias)`` for a dense or quantized ``w``; x [..., K] -> [..., N].

    For a quantized ``w`` with at least ``w.dense_from_rows`` rows of ``x``: its kept dense copy multiplies, or
    with a ``scratch`` given the weight is dequantized into the scratch buffer and multiplied densely; otherwise
    the quantized kernel runs."""
    if isinstance(w, Tensor):
        return F.linear(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    large = x2.shape[0] >= w.dense_from_rows
    if large and w.dense is not None:
        out2 = F.linear(x2, w.dense, bias)
    elif large and scratch is not None and x.device.type == "cpu":
        out2 = F.linear(x2, w.dequantize(out=scratch.get(w.shape, w.dtype, w.device)), bias)
    else:
        out2 = w.matmul(x2.contiguous())
        if bias is not None:
            out2 = out2.add_(bias)
    return out2.view(*x.shape[:-1], w.shape[0])
