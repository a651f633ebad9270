"""The batched LoRA kernel's tables as it reads them (``lp_lora_delta`` in ``src/lora.cpp``): one (layer, site)
table prepared once (``lora_site``: shapes checked, the ctypes arguments built) and run every step by
``NativeKernels.lora_delta``, or all of a step's by ``lp_decode_stack`` (``StackLora``). Preparing needs no
library; ``service.adapters.lora.batch`` keeps each table's ``LoraSite`` until the table's tensors are replaced.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from service.kernels import KERNEL_DTYPES

__all__ = ["LORA_FIELDS", "LoraSegment", "LoraSite", "StackLora", "lora_site"]

LORA_FIELDS = 12  # int64s of ``LoraSite.fields`` (src/decode.cpp's LoraField; the library says its own at load)


@dataclass(frozen=True)
class LoraSegment:
    """One module of a LoRA site: columns ``[start, start + r)`` of ``h``, output columns from ``col``, ``bt``
    [G, r, out_m] (the scaled B^T), optional ``scale`` (DoRA, float32) / ``bias`` (the tables' dtype) [G, out_m]."""

    start: int
    col: int
    bt: Tensor
    scale: Tensor | None = None
    bias: Tensor | None = None


@dataclass(frozen=True)
class LoraSite:
    """A (layer, site) table prepared for ``NativeKernels.lora_delta``: its shapes and the ctypes arguments pointing
    into ``tensors`` (A first), which it keeps alive."""

    tensors: tuple[Tensor, ...]
    groups: int  # G: the tables' leading axis
    width: int  # R: the site's ranks summed
    in_features: int
    cols: int  # the output columns the modules reach
    dtype: torch.dtype
    strides: tuple[int, ...]  # A's, in elements
    args: tuple[Any, Any, Any, Any]  # the modules' (start, rank, col, out_m), Bt, scale and bias pointers
    fields: Any  # all of it as one int64 row, for a decode step in one call (src/decode.cpp's LoraField)


@dataclass(frozen=True)
class StackLora:
    """The LoRA of a decode step in one compiled call (``lp_decode_stack``): ``sites`` int64 [layers * 4], per layer
    and projection (``PROJ_NAMES`` order) the address of its ``LoraSite.fields`` (0: none); the batch rows ``span``
    [lo, hi) they apply to and ``rows`` int64 [hi - lo], each row's table row (-1: none), as ``lora_delta`` takes."""

    sites: Any
    span: tuple[int, int]
    rows: Tensor
    keep: tuple[LoraSite, ...]  # the sites whose fields ``sites`` points to, alive while this is


def lora_site(a: Tensor, segments: Sequence[LoraSegment]) -> LoraSite:
    """``a`` [G, R, in] (any strides: rows that are not contiguous float32 are gathered per call) and one
    ``LoraSegment`` per module, float32 or bfloat16 CPU tables, as ``lora_delta`` reads them."""
    g, width, k = a.shape
    if a.dtype not in KERNEL_DTYPES or a.device.type != "cpu" or not segments:
        raise ValueError(f"lora_site: tables {a.dtype} on {a.device} with {len(segments)} modules")
    n = len(segments)
    seg, bts = (ctypes.c_int64 * (4 * n))(), (ctypes.c_void_p * n)()
    scales, biases = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
    for i, s in enumerate(segments):
        r, out_m = s.bt.shape[1], s.bt.shape[2]
        seg[4 * i : 4 * i + 4] = [s.start, r, s.col, out_m]
        if s.bt.dtype != a.dtype or s.bt.shape[0] != g or not s.bt.is_contiguous() or s.start + r > width:
            raise ValueError(f"lora_site: module {i}: bt {s.bt.dtype} {tuple(s.bt.shape)} for a {tuple(a.shape)}")
        for extra, dtype in ((s.scale, torch.float32), (s.bias, a.dtype)):
            wrong = extra is not None and (extra.dtype != dtype or extra.shape != (g, out_m))
            if extra is not None and (wrong or not extra.is_contiguous()):
                raise ValueError(f"lora_site: module {i}: scale / bias {extra.dtype} {tuple(extra.shape)}")
        bts[i] = s.bt.data_ptr()
        scales[i] = None if s.scale is None else s.scale.data_ptr()
        biases[i] = None if s.bias is None else s.bias.data_ptr()
    cols = max(s.col + s.bt.shape[2] for s in segments)
    keep = (a, *(t for s in segments for t in (s.bt, s.scale, s.bias) if t is not None))
    refs = [ctypes.addressof(arr) for arr in (seg, bts, scales, biases)]
    fields = (ctypes.c_int64 * LORA_FIELDS)(a.data_ptr(), KERNEL_DTYPES.index(a.dtype), *a.stride(), width, n, *refs, g)
    return LoraSite(keep, g, width, k, cols, a.dtype, a.stride(), (seg, bts, scales, biases), fields)
