"""A bf16 model's projection kept in pairs for the CPU's bf16 dot products: ``Bf16Pairs``, lossless.

    Bf16Pairs.pack(w [N, K], kernels) -> Bf16Pairs      w rounded to bf16 (exact for a bf16 checkpoint)
    PairsTable(Bf16Pairs) -> PairsTable                  the same for the [vocab, hidden] embedding / output head
    pairs_wanted(dtype, device, kernels) -> bool          whether a dense model of ``dtype`` should keep them

The layout of ``lp_pairs_matmul`` (``service/kernels/src/pairs.cpp``): [ceil(N / 16), ceil(K / 2), 16, 2], block b
holding rows 16 b .. 16 b + 15, pair p of each row its inputs 2 p and 2 p + 1 side by side (zeros pad N and an odd
K). One 64-byte load is one ``vdpbf16ps`` operand: 16 rows' pair p against x's pair p broadcast, so the kernel
multiplies at ~1.5-2x torch's GEMM over the same bf16 weight from 4 to 32 rows and at ~2.5x from 1 to 4 (bench/
README.md, "bf16 weights in pairs"). The values are the checkpoint's: ``dequantize`` gives them back exactly, and
the product is float32 sums of exact products, rounded once to bf16, each row's result the same at every batch
size (prefill and decode alike). The kernel serves every row count (``dense_from_rows`` is ``NEVER``: at 512 rows
it is still torch's match). CPU only; chosen at load for a dense bf16 model where the kernels have bf16 dot
products or are the avx2 build (``pairs_wanted``; ``service.model.load_folder``). The output head too
(``PairsTable``, the tied embedding with it): float32 logits from float32 sums of exact products, so a bf16 model
needs no float32 rescoring of its top tokens, and the head reads half the bytes of a float32 one.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from service.kernels.native import NativeKernels
from service.model.weights.dispatch import NEVER
from service.model.weights.protocol import tensor_nbytes

__all__ = ["PAIR_ROWS", "Bf16Pairs", "PairsTable", "pairs_wanted"]

PAIR_ROWS = 16  # weight rows a block holds (one 16-lane accumulator)


def pairs_wanted(dtype: torch.dtype, device: torch.device, kernels: NativeKernels | None) -> bool:
    """A dense model of ``dtype`` on ``device`` keeps its projections as ``Bf16Pairs``: bf16 on the CPU, with kernels
    that run bf16 dot products, or the avx2 build, whose portable code of the same arithmetic is ahead of torch's
    bf16 GEMM there (a bf16 step 2.9x at 8 rows, 3.3x at 32; bench/README.md, "Sixteen lanes in registers on
    avx2"). Not on the generic build, nor on AVX-512 CPUs without bf16 dot products (not measured)."""
    if dtype != torch.bfloat16 or device.type != "cpu" or kernels is None:
        return False
    return kernels.bf16_dot or kernels.isa == "avx2"


@dataclass(frozen=True, eq=False)
class Bf16Pairs:
    """A bf16 [N, K] weight in ``lp_pairs_matmul``'s layout, ``packed`` [ceil(N / 16), ceil(K / 2), 16, 2]."""

    packed: Tensor
    rows: int  # N
    cols: int  # K
    kernels: NativeKernels
    dense_from_rows: int = NEVER
    dense: Tensor | None = None  # the weight [N, K], kept by ``with_dense_copy``
    kind: ClassVar[str] = "bf16-pairs"
    dequantize_kernel: ClassVar[str] = "pair unpack"
    dtype: ClassVar[torch.dtype] = torch.bfloat16

    @classmethod
    def pack(cls, w: Tensor, kernels: NativeKernels) -> Bf16Pairs:
        if w.dim() != 2 or w.shape[1] < 1 or not w.is_floating_point() or w.device.type != "cpu":
            raise ValueError(f"w must be a 2-D floating CPU tensor [N, K], got {w.dtype} {list(w.shape)} on {w.device}")
        n, k = w.shape
        blocks, pairs = -(-n // PAIR_ROWS), -(-k // 2)
        padded = F.pad(w.to(torch.bfloat16), (0, 2 * pairs - k, 0, blocks * PAIR_ROWS - n))
        packed = padded.view(blocks, PAIR_ROWS, pairs, 2).permute(0, 2, 1, 3).contiguous()
        return cls(packed, n, k, kernels)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.packed) + tensor_nbytes(self.dense)

    @property
    def kernel_name(self) -> str:
        return f"{self.kernels.name} bf16 pair kernel{'' if self.kernels.bf16_dot else ' (portable)'}"

    def dequantize(self, dtype: torch.dtype | None = None, *, out: Tensor | None = None) -> Tensor:
        """The weight [N, K] (into ``out`` when given), exactly the bf16 values the kernel multiplies by."""
        blocks, pairs = self.packed.shape[:2]
        w = self.packed.permute(0, 2, 1, 3).reshape(blocks * PAIR_ROWS, 2 * pairs)[: self.rows, : self.cols]
        if out is not None:
            return out.copy_(w)
        return w.to(dtype or self.dtype, copy=True)

    def matmul(self, x2: Tensor) -> Tensor:
        """x2 [M, K] bf16, contiguous -> [M, N] bf16 by the native kernel."""
        return self.kernels.pairs_matmul(x2, self.packed, self.rows, x2.dtype)

    def with_dense_copy(self) -> Bf16Pairs:
        if self.dense is not None:
            return self
        return dataclasses.replace(self, dense=self.dequantize())

    def with_dispatch(self, dense_from_rows: int, *, keep_dense: bool = True) -> Bf16Pairs:
        return dataclasses.replace(self, dense_from_rows=dense_from_rows, dense=self.dense if keep_dense else None)

    def probe(self, rows: int, gen: torch.Generator) -> tuple[Bf16Pairs, Tensor]:
        w = torch.randn(rows, self.cols, generator=gen).to(torch.bfloat16)
        return Bf16Pairs.pack(w, self.kernels), w.float()


class PairsTable:
    """A bf16 [vocab, hidden] table in pairs (``protocol.EmbeddingTable``): the output head through
    ``lp_pairs_matmul`` in float32 at every row count, the embedding by gathering rows out of the blocks (exact).
    The self-check's fallback (``drop_fast_path``) keeps the table dense for torch's GEMM instead."""

    def __init__(self, weight: Bf16Pairs) -> None:
        self.weight = weight
        self.dense: Tensor | None = None  # [vocab, hidden] bf16, kept by ``keep_dense``: projected by torch's GEMM
        self.screen = False  # no int8 screen of a bf16 table (``top``)

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    @property
    def draft_rows(self) -> int:
        """Every row count: the pairs product beats torch's bf16 GEMM over a dense copy (1.9-2.9x at 1-32 rows on an
        AVX-512 BF16 EPYC), and a kept dense copy is the one a draft would make."""
        return sys.maxsize

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + tensor_nbytes(self.dense)

    def gather(self, tokens: Tensor) -> Tensor:
        """tokens [...] int64 -> [..., hidden] bf16: row t is block t // 16, lane t % 16, every pair."""
        flat, cols = tokens.reshape(-1), self.weight.cols
        picked = self.weight.packed[flat // PAIR_ROWS, :, flat % PAIR_ROWS]  # [n, K / 2, 2]
        return picked.reshape(flat.numel(), -1)[:, :cols].reshape(*tokens.shape, cols)

    def top(self, hidden: Tensor) -> None:
        """``EmbeddingTable.top``: never screened, the caller takes the max of ``project``."""
        return None

    def project(self, hidden: Tensor) -> Tensor:
        """hidden [..., hidden] -> [..., vocab]: float32 from the kernel (bf16 from the kept dense copy)."""
        x2 = hidden.reshape(-1, hidden.shape[-1]).to(torch.bfloat16).contiguous()
        if self.dense is not None:
            out = F.linear(x2, self.dense)
        else:
            out = self.weight.kernels.pairs_matmul(x2, self.weight.packed, self.weight.rows, torch.float32)
        return out.view(*hidden.shape[:-1], -1)

    def rows(self, index: Tensor) -> Tensor:
        return self.gather(index).float()

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        return self.weight.dequantize(dtype)

    def kernel_for(self, rows: int) -> str:
        return "dense matmul over the kept copy" if self.dense is not None else f"{self.weight.kernel_name}, float32"

    def drop_fast_path(self, rows: int) -> bool:
        return self.keep_dense() > 0

    def keep_dense(self) -> int:
        if self.dense is not None:
            return 0
        self.dense = self.weight.dequantize()
        return tensor_nbytes(self.dense)
