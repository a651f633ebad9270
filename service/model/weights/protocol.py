"""What the model layer knows of a weight: the protocols every compact kind implements, and the one ``linear``.

A projection weight is a dense ``Tensor`` [N, K] (N = out_features rows, K = in_features columns) or a ``Weight``:
a compact form (int8, int4, ...) that multiplies by its own kernel, dequantizes exactly the values that kernel
uses, and may keep a dense copy for large batches. An embedding / output head is a dense tensor or an
``EmbeddingTable`` (a GGUF Q8_0 table). ``service.model.llama`` imports this module and nothing else of the
package: a new kind implements the protocol in its own module, and neither the model nor ``linear`` changes.

Never imports a kind, the model or a loader.
"""

from __future__ import annotations

from typing import Protocol, Self

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "NATIVE_DENSE_ROWS", "DenseKernel", "EmbeddingTable", "ProjWeight", "Scratch", "Weight", "dense_head", "linear",
    "native_dense_rows", "tensor_nbytes",
]  # fmt: skip

# Up to these rows of x a dense weight's product runs on the compiled kernel (``DenseKernel``), per kernel variant
# and dtype; from there on torch's GEMM. At one row torch reads a float32 weight at about 11 GB/s on a 2-core AVX-512
# EPYC, the kernel at 20-28; in float32 the kernel stays ahead up to 64 rows on avx512 (1.7 against 1.8 ms at 64 rows
# of a 3072x576 projection, torch 10 % ahead at 128), up to 8 on avx2 (torch 12 % ahead at 16, with torch held to
# AVX2 as well); in bf16 torch catches up by 8 rows (bench/README.md, "Dense products of a few rows" and "Sixteen
# lanes in registers on avx2").
NATIVE_DENSE_ROWS = {
    "avx512": {torch.float32: 64, torch.bfloat16: 4},
    "avx2": {torch.float32: 8, torch.bfloat16: 4},
    "generic": {torch.float32: 8, torch.bfloat16: 4},
}


class Weight(Protocol):
    """A weight-only compact [N, K] projection weight in its compute dtype (the activations' dtype)."""

    @property
    def kind(self) -> str:
        """``"int8"``, ``"int4"``, ``"q4"``: how the self-check and the logs name the kind."""
        ...

    @property
    def dense_from_rows(self) -> int:
        """Rows of the input (M) from which ``linear`` runs a dense matmul instead of the kernel."""
        ...

    @property
    def dense(self) -> Tensor | None:
        """The dequantized weight [N, K], kept by ``with_dense_copy``."""
        ...

    @property
    def shape(self) -> tuple[int, int]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def nbytes(self) -> int:
        """Bytes held, a kept dense copy included."""
        ...

    @property
    def dequantize_kernel(self) -> str:
        """How ``dequantize`` reads the compact form (reported by the self-check)."""
        ...

    @property
    def kernel_name(self) -> str:
        """Which kernel ``matmul`` runs, e.g. ``"torch int4 kernel"`` (reported by the self-check)."""
        ...

    def matmul(self, x2: Tensor) -> Tensor:
        """x2 [M, K] contiguous, compute dtype -> [M, N] by the kind's kernel."""
        ...

    def dequantize(self, dtype: torch.dtype | None = None, *, out: Tensor | None = None) -> Tensor:
        """The dense weight [N, K] (into ``out`` when given): exactly the values the kernel multiplies by."""
        ...

    def with_dense_copy(self) -> Self:
        """The same weight keeping its dequantized copy (``dense``), multiplied by from the copy's row threshold."""
        ...

    def with_dispatch(self, dense_from_rows: int, *, keep_dense: bool = True) -> Self:
        """The same weight with another dense-matmul threshold (``keep_dense=False``: and no dense copy)."""
        ...

    def probe(self, rows: int, gen: torch.Generator) -> tuple[Self, Tensor]:
        """A weight of this kind, width, dtype and device with ``rows`` rows built from seeded random values, and
        those values in float32 computed from the raw numbers, never through the weight's own unpack."""
        ...


class EmbeddingTable(Protocol):
    """A [vocab, hidden] embedding / output head kept in a compact form (``service.model.weights.q8_table``)."""

    screen: bool  # ``top`` may screen; the self-check turns it off where it disagrees with ``project``

    @property
    def nbytes(self) -> int: ...

    @property
    def shape(self) -> tuple[int, int]: ...

    def gather(self, tokens: Tensor) -> Tensor:
        """tokens [...] int64 -> [..., hidden] in the model dtype."""
        ...

    def project(self, hidden: Tensor) -> Tensor:
        """hidden [..., hidden] -> [..., vocab]: the table as the output head, in the model dtype, or in float32
        where the path computes float32 logits exactly from the table as stored (no rescoring needed)."""
        ...

    @property
    def draft_rows(self) -> int:
        """Up to this many hidden states ``project`` is faster than a dense copy of the table (its compiled kernel),
        so Medusa heads draft through the table itself (``Llama.draft_head``); 0: never."""
        ...

    def top(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """hidden [M, hidden] -> the row max and first argmax of the logits a plain decode step's rows get, exactly
        (``project``'s up to its kernel's rows; past them, the kernel's row by row), without computing them all
        where the table can (a greedy step needs nothing else), and the logits computed per row (0: all; -1: all,
        no screen ran); None where it cannot."""
        ...

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The whole table [vocab, hidden]."""
        ...

    def rows(self, index: Tensor) -> Tensor:
        """Rows ``index`` [n] of the table as float32 [n, hidden], exactly (the self-check's reference)."""
        ...

    def kernel_for(self, rows: int) -> str:
        """How ``project`` computes ``rows`` hidden states (reported by the self-check)."""
        ...

    def drop_fast_path(self, rows: int) -> bool:
        """Stop using the optional form that projects ``rows`` states (it failed the self-check); False if none."""
        ...

    def keep_dense(self) -> int:
        """Keep a dense copy for projecting batches; the bytes it added (0 if kept already)."""
        ...


ProjWeight = Tensor | Weight  # a dense [out, in] weight, or a compact one


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


def tensor_nbytes(t: Tensor | None) -> int:
    """Bytes of ``t``'s elements (0 for None)."""
    return 0 if t is None else t.numel() * t.element_size()


class DenseKernel(Protocol):
    """``service.kernels.native.NativeKernels``' dense product: x2 [M, K] @ w^T in ``out_dtype``, float32 sums of the
    values as stored, each row's result the same at every M; ``isa`` the variant (``NATIVE_DENSE_ROWS``' key)."""

    isa: str

    def dense_matmul(self, x2: Tensor, w: Tensor, out_dtype: torch.dtype) -> Tensor: ...


def native_dense_rows(dtype: torch.dtype, native: DenseKernel | None) -> int:
    """The most rows of x a dense weight of ``dtype`` multiplies on ``native``'s kernel (0: never)."""
    return 0 if native is None else NATIVE_DENSE_ROWS.get(native.isa, {}).get(dtype, 0)


def _kernel_for(x2: Tensor, w: Tensor, native: DenseKernel | None) -> DenseKernel | None:
    """``native`` where it takes x2 [M, K] @ w^T: up to ``native_dense_rows`` rows in w's dtype, w contiguous on the
    CPU; else None (torch's GEMM)."""
    rows = native_dense_rows(w.dtype, native)
    fits = x2.shape[0] <= rows and x2.dtype == w.dtype and w.device.type == "cpu" and w.is_contiguous()
    return native if fits else None


def dense_head(hidden: Tensor, head: Tensor, native: DenseKernel | None) -> Tensor:
    """``F.linear(hidden, head)``; on the kernel (few rows) in float32 whatever the model's dtype: exact logits."""
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if (kernel := _kernel_for(h2, head, native)) is None:
        return F.linear(hidden, head)
    return kernel.dense_matmul(h2.contiguous(), head, torch.float32).view(*hidden.shape[:-1], head.shape[0])


def linear(
    x: Tensor, w: ProjWeight, bias: Tensor | None = None, *, scratch: Scratch | None = None,
    native: DenseKernel | None = None,
) -> Tensor:  # fmt: skip
    """``F.linear(x, w, bias)`` for a dense or compact ``w``; x [..., K] -> [..., N].

    A dense ``w`` without bias and up to ``native_dense_rows`` rows of ``x`` in its dtype multiplies on ``native``'s
    kernel where given. For a compact ``w`` with at least ``w.dense_from_rows`` rows of ``x``: its kept dense copy
    multiplies, or with a ``scratch`` given the weight is dequantized into the scratch buffer and multiplied densely;
    otherwise the kind's kernel runs."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if isinstance(w, Tensor):
        if bias is not None or (kernel := _kernel_for(x2, w, native)) is None:
            return F.linear(x, w, bias)
        return kernel.dense_matmul(x2.contiguous(), w, w.dtype).view(*x.shape[:-1], w.shape[0])
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
