"""Where ``linear`` leaves a compact kind's kernel for a dense matmul: rows per CPU capability, kind and dtype.

Rows are M = batch x tokens. ``DENSE_FROM_ROWS``: from there dequantizing into the model's scratch buffer and a
dense matmul beat the kernel; ``DENSE_COPY_FROM_ROWS``: from there a weight's kept dense copy (``with_dense_copy``)
does. Measured with bench/quant_kernels.py on one Sapphire Rapids VM (bench/README.md, "Quantized kernels per
capability"): AVX512 natively; AVX2 and DEFAULT with torch, oneDNN and MKL all held to that instruction set
(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS): the kernels of such a CPU, not its memory.
float16 (unmeasured) takes bfloat16's; an unlisted capability (aarch64's, POWER's) takes DEFAULT's; CUDA always
uses the kernel. ``NEVER``: the kernel wins at every measured M (emulated bf16 makes dense matmuls slow).
"""

from __future__ import annotations

import sys

import torch

from service.platform import cpu_capability

__all__ = ["COMPUTE_DTYPES", "DENSE_COPY_FROM_ROWS", "DENSE_FROM_ROWS", "NEVER", "compute_dtype", "dense_from_rows"]

NEVER = sys.maxsize
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _table(f32: tuple[int, int], bf16: tuple[int, int]) -> dict[tuple[str, torch.dtype], int]:
    """(int8, int4) rows in float32 and in bfloat16 (and float16)."""
    rows: dict[tuple[str, torch.dtype], int] = {}
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


def dense_from_rows(kind: str, dtype: torch.dtype, *, copy: bool = False) -> int:
    """Rows from which ``linear`` leaves ``kind``'s kernel for a dense matmul on this CPU (``copy``: over a kept
    dense copy; else dequantizing into the scratch buffer)."""
    table = DENSE_COPY_FROM_ROWS if copy else DENSE_FROM_ROWS
    return table.get(cpu_capability(), table["DEFAULT"])[kind, dtype]


def compute_dtype(dtype: torch.dtype | None, fallback: torch.dtype) -> torch.dtype:
    """``dtype`` (``fallback`` when None), refused unless torch's kernels take it for activations and scales."""
    dtype = fallback if dtype is None else dtype
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
    return dtype
