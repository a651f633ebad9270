"""A GGUF Q8_0 embedding / output head kept as stored: ``Q8Table``, exact both ways (see the class).

Built by the GGUF loader (``service.model.load_gguf``) from ``Int8Rows`` read group-major; used by the model
through ``protocol.EmbeddingTable`` only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from service.kernels.native import NativeKernels
from service.kernels.native_blocks import q8_lanes
from service.loading.gguf_blocks import GROUP, Int8Rows
from service.model.weights.dispatch import dense_from_rows
from service.model.weights.int4 import Int4Weight
from service.model.weights.int4_layout import chunks_concatenate, pack_cpu
from service.model.weights.protocol import tensor_nbytes

__all__ = [
    "HEAD_CHUNK_ROWS",
    "NATIVE_MAX_ROWS",
    "PAIR_CHUNK_ROWS",
    "PAIR_MAX_ROWS",
    "SCREEN_CAP",
    "SCREEN_MIN_ROWS",
    "Q8Table",
]

# Vocabulary rows the head dequantizes at a time when it projects several hidden states (``Q8Table.project``).
HEAD_CHUNK_ROWS = 4096
# Vocabulary rows packed at a time into the head's int4 pair (reused buffers: two [rows, hidden] int32).
PAIR_CHUNK_ROWS = 1024
# Up to this many hidden states, a head with its int4 pair (``Q8Table.pair_for_head``) projects through the pair:
# 2 kernel calls over all columns; beyond, chunks win (bench/README.md, "GGUF served directly").
PAIR_MAX_ROWS = 8
# Up to this many hidden states, per compute dtype, a head given the native kernels (``service.kernels.native``)
# projects through ``lp_q8_matmul``: 12x the per-group kernel at one row in float32, 1.5x the int4 pair in bfloat16;
# in float32 1.4-1.9x the dense matmul over dequantized chunks at 16-32 rows (it converts a block of the table once
# for 4 rows); beyond, the pair and dense matmuls win (bench/README.md, "Native kernels").
NATIVE_MAX_ROWS = {torch.float32: 32, torch.bfloat16: 1, torch.float16: 1}
# From this many hidden states on (past NATIVE_MAX_ROWS in chunks of at most that many), ``top`` screens the logits
# in int8 where the CPU has AVX-512 VNNI: 1.25x the full product and its max at 6 rows, 2.2x at 32, even at 4
# (bench/head_screen.py).
SCREEN_MIN_ROWS = 6
SCREEN_CAP = 256  # logits a screened row computes exactly at most; a row with more candidates is computed in full
# Up to this many rows Medusa heads draft through ``lp_q8_matmul`` rather than a dense bf16 copy of the head (2.2 /
# 1.8 / 1.1x at 1 / 4 / 8 rows, 0.7x at 16 on an AVX-512 BF16 EPYC; the copy, 56-113 MB, is then never made).
DRAFT_MAX_ROWS = 8


class Q8Table:
    """A [vocab, hidden] table kept as Q8_0 blocks (``w = q * d`` per 32 columns), used exactly both ways: as the
    embedding (a gather dequantizes only the rows asked for) and as the output head. One hidden state is projected
    by one int8-kernel call per column group, each with that group's per-row scales, summed: the kernel's
    one-scale-per-row format expresses each group exactly, where one call over all columns would need the table
    requantized. Several (a batch's decode step) go through dense matmuls instead, over the dense copy when one
    is kept (``keep_dense``) or chunks of ``HEAD_CHUNK_ROWS`` vocabulary rows dequantized into one small buffer:
    the kernel with more than one row costs tens of times more (bench/README.md, "GGUF served directly").

    In bf16 / fp16 the head also holds an **int4 pair** (``pair_for_head``): each value ``q = 16 * hi + lo`` with
    ``lo = q & 15`` and ``hi = q >> 4``, so ``w = d * lo + 16 d * hi`` is two int4-kernel weights whose groups of
    32 are Q8_0's blocks: ``lo`` with scale ``d`` and zero ``8 d``, ``hi + 8`` with scale ``16 d`` and zero 0
    (``(q4 - 8) * scale + zero``). Both scales are the table's own bf16 ``d`` times a power of two, so the pair
    holds the table's values; up to ``PAIR_MAX_ROWS`` rows it projects with two kernel calls over all columns,
    half the per-group kernel's time at one row and closer to the float32 reference. float32 keeps the per-group
    kernel (torch's int4 kernel is slow with float32 activations).

    With the native kernels (``native``), up to ``NATIVE_MAX_ROWS`` rows project through ``lp_q8_matmul`` instead:
    the table as stored, float32 products and sums, returned in float32 whatever the compute dtype (the logits as
    exact as a float32 model's, so a bf16 model's head needs no float32 rescoring of its top tokens).

    Layout: ``q`` [G, vocab, 32] int8 and ``d`` [G, vocab] in the compute dtype, G = hidden / 32: each group's
    slice is contiguous, as the kernels need."""

    def __init__(self, rows: Int8Rows, dtype: torch.dtype, native: NativeKernels | None = None) -> None:
        """``rows`` from ``Int8Rows.group_major`` (its storage becomes the table's, no copy)."""
        self.q = rows.q.transpose(0, 1)  # [G, V, 32]
        if not self.q.is_contiguous():
            raise ValueError("Q8Table needs group-major rows (Int8Rows.group_major)")
        self.d = rows.scale.t().to(dtype).contiguous()  # [G, V]
        self.dtype = dtype
        self.dense: Tensor | None = None  # [V, hidden] in the compute dtype, see keep_dense
        self.pair: tuple[Int4Weight, Int4Weight] | None = None  # (lo, hi), see pair_for_head
        self.native = native
        self.screen = True  # ``top`` may screen (the self-check turns it off if it disagrees with ``project``)
        self._bounds: Tensor | None = None  # [G, V] float32, >= |d| ||q||_2 of each group (``top``)
        self._lanes: Tensor | None = None  # q + 128 laid out for the screen's VNNI products (``q8_lanes``)
        self._scratch = torch.empty(0)  # ``top``'s float32 upper bounds, reused

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[1], self.q.shape[0] * GROUP)

    @property
    def draft_rows(self) -> int:
        return DRAFT_MAX_ROWS if self.native is not None and self.dtype == torch.float32 else 0

    @property
    def nbytes(self) -> int:
        pair = 0 if self.pair is None else sum(w.nbytes for w in self.pair)
        screen = tensor_nbytes(self._bounds) + tensor_nbytes(self._lanes) + tensor_nbytes(self._scratch)
        return self.q.numel() + tensor_nbytes(self.d) + tensor_nbytes(self.dense) + pair + screen

    def gather(self, tokens: Tensor) -> Tensor:
        """tokens [...] int64 -> [..., hidden] in the compute dtype."""
        flat = tokens.reshape(-1)
        q = self.q[:, flat].to(self.dtype)  # [G, n, 32]
        w = (q * self.d[:, flat, None]).transpose(0, 1)  # [n, G, 32]
        return w.reshape(*tokens.shape, -1)

    def project(self, hidden: Tensor) -> Tensor:
        """hidden [..., hidden] -> [..., vocab] in the compute dtype, or float32 from the native kernel."""
        x2 = hidden.reshape(-1, hidden.shape[-1]).to(self.dtype)  # [M, K]
        if self.native is not None and x2.shape[0] <= NATIVE_MAX_ROWS[self.dtype]:
            out = self.native.q8_matmul(x2.contiguous(), self.q, self.d, torch.float32)
            return out.view(*hidden.shape[:-1], -1)
        if self.pair is not None and x2.shape[0] <= PAIR_MAX_ROWS:
            x2 = x2.contiguous()
            lo, hi = self.pair
            return lo.matmul(x2).add_(hi.matmul(x2)).view(*hidden.shape[:-1], -1)
        if x2.shape[0] > 1:
            out = F.linear(x2, self.dense) if self.dense is not None else self._project_chunks(x2)
            return out.view(*hidden.shape[:-1], -1)
        out = torch._weight_int8pack_mm(x2[:, :GROUP].contiguous(), self.q[0], self.d[0])  # [M, V]
        for g in range(1, self.q.shape[0]):
            out += torch._weight_int8pack_mm(x2[:, g * GROUP : (g + 1) * GROUP].contiguous(), self.q[g], self.d[g])
        return out.view(*hidden.shape[:-1], -1)

    def top(self, hidden: Tensor, min_rows: int = SCREEN_MIN_ROWS) -> tuple[Tensor, Tensor, Tensor] | None:
        """hidden [M, hidden] -> (values [M] float32, indices [M] int64, found [M] int32): the max of the native
        kernel's float32 logits exactly (the first index on a tie; NaN and infinities as ``NativeKernels.row_top``),
        from an int8 screen that computes only the logits it cannot rule out (``NativeKernels.q8_top``: found[r] of
        them); a row it cannot screen is projected in full by the kernel (found 0); without the screen, -1.

        Past ``NATIVE_MAX_ROWS`` rows (a speculative step verifying 4 rows x 9 positions, a wide Medusa tree) the
        rows go in near-equal chunks the kernel takes, screened where the CPU can (~2.5x faster than the dense
        product of that many rows, bench/README.md, "The head past 32 rows"), else in full (found -1): either way
        each row's argmax is the one a plain decode step computes, whatever the step's width, so a verified draft
        keeps plain greedy's tokens even on near-ties (``project`` past those rows is a dense product, other sums).
        None where neither applies (fewer than ``min_rows`` rows, or at most ``NATIVE_MAX_ROWS`` without the screen:
        ``project`` runs the kernel itself; not the native kernel's path): the caller takes the max of ``project``."""
        m, native, most = hidden.shape[0], self.native, NATIVE_MAX_ROWS[self.dtype]
        if native is None or hidden.dim() != 2 or most < min_rows:
            return None
        screen = native.q8_screen and self.screen
        if m < min_rows or (m <= most and not screen):
            return None
        if screen and (self._bounds is None or self._lanes is None):
            self._bounds, self._lanes = self._screen_bounds(), q8_lanes(self.q)
        x2 = hidden.to(self.dtype).contiguous()
        parts = x2.tensor_split(-(-m // most)) if m > most else (x2,)  # chunks of most / 2 .. most rows
        tops = [self._screened(part.contiguous()) if screen else self._in_full(part.contiguous()) for part in parts]
        values, indices, found = (torch.cat(column) for column in zip(*tops, strict=True))
        return values, indices, found

    def _in_full(self, x2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``top`` of at most ``NATIVE_MAX_ROWS`` rows x2 [M, K] from every logit of the kernel (found -1)."""
        assert self.native is not None
        values, indices = self.native.row_top(self.project(x2).float().contiguous())  # the kernel, at these rows
        return values, indices, torch.full((x2.shape[0],), -1, dtype=torch.int32)

    def _screened(self, x2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``top`` of at most ``NATIVE_MAX_ROWS`` rows x2 [M, K] in the compute dtype, screened."""
        native, m = self.native, x2.shape[0]
        assert native is not None and self._bounds is not None and self._lanes is not None
        if self._scratch.numel() < m * self.shape[0]:
            self._scratch = torch.empty(NATIVE_MAX_ROWS[self.dtype] * self.shape[0], dtype=torch.float32)
        values, indices, found = native.q8_top(x2, self.q, self._lanes, self.d, self._bounds, SCREEN_CAP, self._scratch)
        full = (found == 0).nonzero().flatten()
        if full.numel():
            values[full], indices[full] = native.row_top(self.project(x2.index_select(0, full)).float().contiguous())
        return values, indices, found

    def _screen_bounds(self) -> Tensor:
        """[G, V] float32: ``|d| ||q||_2`` of each group, rounded up (float64, then to the next float32 above)."""
        out = torch.empty(self.q.shape[:2], dtype=torch.float32)
        for g in range(self.q.shape[0]):  # a group at a time: no float64 copy of the table
            exact = self.q[g].double().square().sum(-1).sqrt_().mul_(self.d[g].double().abs())
            near = exact.float()
            out[g] = torch.where(near.double() < exact, torch.nextafter(near, torch.tensor(math.inf)), near)
        return out

    def _project_chunks(self, x2: Tensor) -> Tensor:
        """x2 [M, K] -> [M, V]: each chunk of vocabulary rows dequantized (as ``dequantize``) and multiplied."""
        vocab, k = self.shape
        rows = min(HEAD_CHUNK_ROWS, vocab)
        buf = torch.empty(rows, self.q.shape[0], GROUP, dtype=self.dtype, device=x2.device)  # [n, G, 32]
        out_t = torch.empty(vocab, x2.shape[0], dtype=self.dtype, device=x2.device)  # [V, M]
        for start in range(0, vocab, rows):
            n = min(rows, vocab - start)
            torch.mm(self._rows_into(start, buf[:n]).view(n, k), x2.t(), out=out_t[start : start + n])
        return out_t.t()

    def _rows_into(self, start: int, out: Tensor) -> Tensor:
        """Vocabulary rows ``[start, start + n)`` dequantized into ``out`` [n, G, 32] (compute dtype): the values of
        ``dequantize`` (one rounding of the exact ``q * d``)."""
        n = out.shape[0]
        return out.copy_(self.q[:, start : start + n].transpose(0, 1)).mul_(self.d[:, start : start + n].t()[..., None])

    def rows(self, index: Tensor) -> Tensor:
        """Vocabulary rows ``index`` [n] as float32 [n, hidden]: exactly ``q * d``."""
        w = self.q[:, index].float() * self.d[:, index].float()[..., None]  # [G, n, 32]
        return w.transpose(0, 1).reshape(index.numel(), -1)

    def kernel_for(self, rows: int) -> str:
        if self.native is not None and rows <= NATIVE_MAX_ROWS[self.dtype]:
            return f"{self.native.name} q8 kernel"
        if self.pair is not None and rows <= PAIR_MAX_ROWS:
            return "int4 pair: two torch int4 kernel calls"
        if rows > 1 and self.dense is not None:
            return "dense matmul over the kept copy"
        if rows > 1:
            return f"dense matmul over dequantized chunks of {HEAD_CHUNK_ROWS} rows"
        return "torch int8 kernel per 32-column group"

    def drop_fast_path(self, rows: int) -> bool:
        if self.native is not None and rows <= NATIVE_MAX_ROWS[self.dtype]:
            self.native = None
            return True
        if self.pair is not None and rows <= PAIR_MAX_ROWS:
            self.pair = None
            return True
        if rows > 1 and self.dense is not None:
            self.dense = None
            return True
        return False

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        w = (self.q.to(torch.float32) * self.d.float()[..., None]).transpose(0, 1)  # [V, G, 32]
        return w.reshape(self.shape).to(self.dtype if dtype is None else dtype)

    def pair_for_head(self) -> int:
        """Build the int4 pair the head projects a few rows with (bf16 / fp16 compute; see the class docstring);
        returns the bytes it added (0 in float32 or when built already). Packed ``PAIR_CHUNK_ROWS`` rows at a time
        through reused buffers straight into the pair's own tensors where the packer allows it
        (``int4_layout.chunks_concatenate``): temporaries the size of the table would stay in the heap as
        fragmentation. Elsewhere the table is packed whole."""
        groups, vocab, _ = self.q.shape
        if self.pair is not None or self.dtype == torch.float32 or vocab % 16:  # the kernel packs 16 rows at once
            return 0
        k = groups * GROUP
        rows = min(PAIR_CHUNK_ROWS, vocab)
        if not chunks_concatenate(pack_cpu, rows, k, vocab % rows):
            rows = vocab
        packed: list[Tensor] = []  # lo, hi: the kernel's layout
        q32 = torch.empty(rows, k, dtype=torch.int32)
        nibble = torch.empty(rows, k, dtype=torch.int32)
        for start in range(0, vocab, rows):
            n = min(rows, vocab - start)
            q = q32[:n]
            q.view(n, groups, GROUP).copy_(self.q[:, start : start + n].transpose(0, 1))  # [n, K]
            torch.bitwise_and(q, 15, out=nibble[:n])  # lo
            lo = pack_cpu(nibble[:n])
            if lo.shape[0] != n:
                raise ValueError(f"the int4 packer made {tuple(lo.shape)} of {n} rows: the pair needs row-major output")
            torch.bitwise_right_shift(q, 4, out=nibble[:n]).add_(8)  # hi + 8
            hi = pack_cpu(nibble[:n])
            if not packed:
                packed = [torch.empty(vocab * lo.numel() // n, dtype=lo.dtype) for _ in range(2)]
            at = start * lo.numel() // n
            packed[0][at : at + lo.numel()].copy_(lo.reshape(-1))
            packed[1][at : at + hi.numel()].copy_(hi.reshape(-1))
        shape = (vocab, *lo.shape[1:])  # the packer keeps one row of output per weight row (checked above)
        d = self.d  # [G, V] in the compute dtype: the table's own scales; times 8 and 16 they stay exact
        scales = (torch.stack((d, 8 * d), dim=-1), torch.stack((16 * d, torch.zeros_like(d)), dim=-1))  # [G, V, 2]
        dense_from = dense_from_rows("int4", self.dtype)
        lo_w, hi_w = (
            Int4Weight(p.view(shape), sz.contiguous(), GROUP, k, dense_from)
            for p, sz in zip(packed, scales, strict=True)
        )
        self.pair = (lo_w, hi_w)
        return lo_w.nbytes + hi_w.nbytes

    def keep_dense(self) -> int:
        """Keep the dequantized table for projecting batches (``--dense-copies-mb``); returns the bytes it added."""
        if self.dense is not None:
            return 0
        groups, vocab, _ = self.q.shape
        dense = torch.empty(vocab, groups, GROUP, dtype=self.dtype, device=self.q.device)  # [V, G, 32]
        self.dense = self._rows_into(0, dense).view(self.shape)
        return tensor_nbytes(self.dense)
