"""From a llama.cpp GGUF file to a ready ``Llama``: config and tokenizer from the HF folder, weights from the GGUF.

The header and tensor table are parsed and checked against the folder's config (``gguf_plan.check_gguf``) before
a data byte is read. Then each :class:`~service.model.gguf_plan.Target` is filled from the open file through one
bounded reused buffer (``RowReader``), never the whole file and never a dense copy of a packed weight:

- projections whose parts are all Q4_0 / Q4_1 become an ``Int4Weight`` (exact: see ``gguf_blocks``), group 32;
- any other projection (F32 / F16 / BF16, Q8_0, or a mix) is dequantized into a dense weight of the model dtype;
- an embedding or output head in Q8_0 stays Q8_0 (``Q8Table``, exact both ways; a tied one is one table);
  stored unquantized, it is dense;
- norms are dense (F32 in llama.cpp's files).

``packed=False`` dequantizes everything into the model dtype instead: the reference the tests compare against.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from service.errors import FailedPrecondition
from service.loading import LoadStats
from service.loading.gguf import GGUFHeader, read_gguf_header
from service.loading.gguf_blocks import GROUP, INT4_TYPES, Int4Rows, Int8Rows, RowReader
from service.metrics import MODEL_LOAD_BYTES, MODEL_LOAD_DURATION, MODEL_LOADED, MODEL_PARAMETER_BYTES
from service.model.config import ModelConfig
from service.model.gguf_plan import Target, check_gguf, gguf_targets, unpermute_rows
from service.model.int4_layout import chunks_concatenate, pack_cpu
from service.model.llama import PROJ_NAMES, Llama, ProjName
from service.model.quant import Int4Weight, dense_from_rows, tensor_nbytes

__all__ = ["Q8Table", "load_gguf_model"]


# Vocabulary rows the head dequantizes at a time when it projects several hidden states (``Q8Table.project``).
HEAD_CHUNK_ROWS = 4096
# Vocabulary rows packed at a time into the head's int4 pair (reused buffers: two [rows, hidden] int32).
PAIR_CHUNK_ROWS = 1024
# Up to this many hidden states, a head with its int4 pair (``Q8Table.pair_for_head``) projects through the pair:
# 2 kernel calls over all columns; beyond, chunks win (bench/README.md, "GGUF served directly").
PAIR_MAX_ROWS = 8


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

    Layout: ``q`` [G, vocab, 32] int8 and ``d`` [G, vocab] in the compute dtype, G = hidden / 32: each group's
    slice is contiguous, as the kernel needs."""

    def __init__(self, rows: Int8Rows, dtype: torch.dtype) -> None:
        """``rows`` from ``Int8Rows.group_major`` (its storage becomes the table's, no copy)."""
        self.q = rows.q.transpose(0, 1)  # [G, V, 32]
        if not self.q.is_contiguous():
            raise ValueError("Q8Table needs group-major rows (Int8Rows.group_major)")
        self.d = rows.scale.t().to(dtype).contiguous()  # [G, V]
        self.dtype = dtype
        self.dense: Tensor | None = None  # [V, hidden] in the compute dtype, see keep_dense
        self.pair: tuple[Int4Weight, Int4Weight] | None = None  # (lo, hi), see pair_for_head

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[1], self.q.shape[0] * GROUP)

    @property
    def nbytes(self) -> int:
        pair = 0 if self.pair is None else sum(w.nbytes for w in self.pair)
        return self.q.numel() + tensor_nbytes(self.d) + tensor_nbytes(self.dense) + pair

    def gather(self, tokens: Tensor) -> Tensor:
        """tokens [...] int64 -> [..., hidden] in the compute dtype."""
        flat = tokens.reshape(-1)
        q = self.q[:, flat].to(self.dtype)  # [G, n, 32]
        w = (q * self.d[:, flat, None]).transpose(0, 1)  # [n, G, 32]
        return w.reshape(*tokens.shape, -1)

    def project(self, hidden: Tensor) -> Tensor:
        """hidden [..., hidden] -> [..., vocab] in the compute dtype."""
        x2 = hidden.reshape(-1, hidden.shape[-1]).to(self.dtype)  # [M, K]
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
        if self.pair is not None and rows <= PAIR_MAX_ROWS:
            return "int4 pair: two torch int4 kernel calls"
        if rows > 1 and self.dense is not None:
            return "dense matmul over the kept copy"
        if rows > 1:
            return f"dense matmul over dequantized chunks of {HEAD_CHUNK_ROWS} rows"
        return "torch int8 kernel per 32-column group"

    def drop_fast_path(self, rows: int) -> bool:
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


def _module(model: Llama, target: Target) -> torch.nn.Module:
    if target.layer is None:
        return model
    block = model.blocks[target.layer]
    if target.attr in ("wqkv", "wo", "bqkv", "bo"):
        return block.attention
    if target.attr in ("w13", "w2", "b13", "b2"):
        return block.feed_forward
    return block


def _dense_dest(model: Llama, target: Target) -> Tensor:
    value = getattr(_module(model, target), target.attr)
    tensor = value.weight if isinstance(value, torch.nn.Module) else value  # the norms are modules
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{target.attr} of layer {target.layer} holds {type(tensor).__name__}, not a dense tensor")
    return tensor.data


def _fill(reader: RowReader, header: GGUFHeader, target: Target, dest: Int4Rows | Int8Rows | Tensor) -> None:
    for part in target.parts:
        t = header.tensors[part.name]
        rows = None
        if part.heads is not None:
            rows = unpermute_rows(part.stop - part.start, part.heads) + part.start
        elif len(target.parts) > 1:
            rows = torch.arange(part.start, part.stop)
        reader.read(t, dest, rows)


def _projection(target: Target) -> tuple[int, ProjName]:
    if target.layer is None or target.attr not in PROJ_NAMES:
        raise ValueError(f"{target.attr} is not a projection")
    return target.layer, target.attr


def _types(header: GGUFHeader, target: Target) -> set[str]:
    return {header.tensors[p.name].ggml_type.name for p in target.parts}


class _Int4Staging:
    """One ``Int4Rows`` buffer for the largest projection, reused by every projection (q as int32: what the kernel's
    packer takes, so it makes no copy of it), so loading allocates no per-projection temporaries."""

    def __init__(self, targets: list[Target]) -> None:
        sizes = [t.shape for t in targets if t.is_projection]
        n, k = max((s[0] * s[1] for s in sizes), default=0), max((s[0] * s[1] // GROUP for s in sizes), default=0)
        self._rows = Int4Rows(torch.empty(n, dtype=torch.int32), torch.empty(k), torch.empty(k))

    def take(self, n: int, k: int) -> Int4Rows:
        r, g = self._rows, k // GROUP
        return Int4Rows(r.q[: n * k].view(n, k), r.scale[: n * g].view(n, g), r.zero[: n * g].view(n, g))


def _load_target(
    reader: RowReader, header: GGUFHeader, model: Llama, target: Target, staging: _Int4Staging | None
) -> None:
    types = _types(header, target)
    if staging is not None and target.is_projection:
        layer, name = _projection(target)
        if types <= INT4_TYPES:
            rows = staging.take(*target.shape)
            _fill(reader, header, target, rows)
            model.set_projection(
                layer, name, Int4Weight.from_q_scale_zero(rows.q, rows.scale, rows.zero, GROUP, dtype=model.dtype)
            )
        else:  # a quantized model's placeholder becomes a dense weight: F16/BF16/F32 or Q8_0 kept exact
            dense = torch.empty(target.shape, dtype=model.dtype)
            _fill(reader, header, target, dense)
            setattr(_module(model, target), target.attr, dense)
    elif staging is not None and target.attr in ("tok_embeddings", "lm_head") and types == {"Q8_0"}:
        rows8 = Int8Rows.group_major(*target.shape)
        _fill(reader, header, target, rows8)
        table = Q8Table(rows8, model.dtype)
        if target.attr == "lm_head" or model.cfg.tie_word_embeddings:
            table.pair_for_head()
        if target.attr == "lm_head":
            model.set_embeddings(model.tok_embeddings, table)
        else:
            model.set_embeddings(table, table if model.cfg.tie_word_embeddings else model.lm_head)
    else:
        _fill(reader, header, target, _dense_dest(model, target))


def load_gguf_model(
    folder: Path, gguf: Path, *, dtype: torch.dtype, device: torch.device | str = "cpu", packed: bool = True
) -> tuple[Llama, ModelConfig, LoadStats]:
    """Config from ``folder``, weights from the GGUF file ``gguf`` (see the module docstring); CPU only.

    Records ``MODEL_LOAD_DURATION`` per stage and ``MODEL_LOAD_BYTES`` with ``mode="gguf"``, as ``load_model``."""
    if torch.device(device).type != "cpu":
        raise FailedPrecondition(f"GGUF weights are served on the CPU only, not {device}")
    t0 = time.perf_counter()
    cfg = ModelConfig.from_hf(Path(folder))
    fd = os.open(gguf, os.O_RDONLY)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            header = read_gguf_header(gguf, f)
        targets = gguf_targets(cfg)
        check_gguf(header, cfg, targets)
        header_seconds = time.perf_counter() - t0
        model = Llama(cfg, dtype=dtype, device=torch.device("cpu"), quantized=packed)
        reader = RowReader(fd)
        t1 = time.perf_counter()
        staging = _Int4Staging(targets) if packed else None
        for target in targets:
            _load_target(reader, header, model, target, staging)
        model.eval()
        read_seconds = time.perf_counter() - t1
    finally:
        os.close(fd)
    stats = LoadStats(
        mode="gguf",
        header_seconds=header_seconds,
        read_seconds=read_seconds,
        convert_seconds=reader.decode_seconds,
        total_seconds=time.perf_counter() - t0,
        bytes_read=reader.bytes_read,
        tensors=sum(len(t.parts) for t in targets),
    )
    for stage in ("header", "read", "convert", "total"):
        MODEL_LOAD_DURATION.labels(stage=stage, mode="gguf").observe(getattr(stats, f"{stage}_seconds"))
    MODEL_LOAD_BYTES.labels(mode="gguf").inc(stats.bytes_read)
    MODEL_PARAMETER_BYTES.set(model.parameter_bytes)
    MODEL_LOADED.set(1)
    return model, cfg, stats
