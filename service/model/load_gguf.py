"""From a llama.cpp GGUF file to a ready ``Llama``: config and tokenizer from the HF folder, weights from the GGUF.

The header and tensor table are parsed and checked against the folder's config (``gguf_plan.check_gguf``) before
a data byte is read. Then each :class:`~service.model.gguf_plan.Target` is filled from the open file through one
bounded reused buffer (``RowReader``), never the whole file and never a dense copy of a packed weight:

- projections whose parts are all Q4_0 / Q4_1 become an ``Int4Weight`` (exact: see ``gguf_blocks``), group 32, or
  in float32 with the native kernels (``service.kernels.native``) a ``Q4Native``, the blocks as Q4_1 stores them;
- any other projection (F32 / F16 / BF16, Q8_0, or a mix) is dequantized into a dense weight of the model dtype;
- an embedding or output head in Q8_0 stays Q8_0 (``Q8Table``, exact both ways; a tied one is one table), projected
  by the native kernels for a few rows where they are loaded;
  stored unquantized, it is dense;
- norms are dense (F32 in llama.cpp's files).

``packed=False`` dequantizes everything into the model dtype instead: the reference the tests compare against.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import Tensor

from service.errors import FailedPrecondition
from service.kernels.native import NativeKernels, kernels
from service.loading import LoadStats
from service.loading.gguf import GGUFHeader, read_gguf_header
from service.loading.gguf_blocks import GROUP, INT4_TYPES, Int4Rows, Int8Rows, RowReader
from service.model.config import ModelConfig
from service.model.gguf_plan import Target, check_gguf, gguf_targets, unpermute_rows
from service.model.llama import PROJ_NAMES, Llama, ProjName
from service.model.weights.int4 import Int4Weight
from service.model.weights.q4_native import Q4Native
from service.model.weights.q8_table import Q8Table

__all__ = ["load_gguf_model"]


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
    reader: RowReader,
    header: GGUFHeader,
    model: Llama,
    target: Target,
    staging: _Int4Staging | None,
    native: NativeKernels | None,
) -> None:
    types = _types(header, target)
    if staging is not None and target.is_projection:
        layer, name = _projection(target)
        if types <= INT4_TYPES:
            rows = staging.take(*target.shape)
            _fill(reader, header, target, rows)
            if native is not None and model.dtype == torch.float32:
                w: Int4Weight | Q4Native = Q4Native.from_q_scale_zero(rows.q, rows.scale, rows.zero, native,
                                                                      dtype=model.dtype)  # fmt: skip
            else:
                w = Int4Weight.from_q_scale_zero(rows.q, rows.scale, rows.zero, GROUP, dtype=model.dtype)
            model.set_projection(layer, name, w)
        else:  # a quantized model's placeholder becomes a dense weight: F16/BF16/F32 or Q8_0 kept exact
            dense = torch.empty(target.shape, dtype=model.dtype)
            _fill(reader, header, target, dense)
            setattr(_module(model, target), target.attr, dense)
    elif staging is not None and target.attr in ("tok_embeddings", "lm_head") and types == {"Q8_0"}:
        rows8 = Int8Rows.group_major(*target.shape)
        _fill(reader, header, target, rows8)
        table = Q8Table(rows8, model.dtype, native)
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

    The stats have ``mode="gguf"``; the caller records them (``service.bootstrap.record_load``)."""
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
        native = kernels() if packed else None  # built or loaded from the cache; None: torch's kernels
        for target in targets:
            _load_target(reader, header, model, target, staging, native)
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
    return model, cfg, stats
