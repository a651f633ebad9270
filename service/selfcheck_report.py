"""The start-up self-check's results (``service.selfcheck``): each path's check, the report, and the errors they
measure."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PathCheck", "SelfCheckReport", "exact_top", "rel_error"]


@dataclass(frozen=True)
class PathCheck:
    path: str  # what computes, e.g. "int4 projection 3072x576: dequantized dense"
    kernel: str  # how, e.g. "torch int4 kernel"
    error: float  # largest per-row relative error against the float32 reference
    tolerance: float
    status: str  # "ok", "fallback: ..." or "failed"

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


@dataclass(frozen=True)
class SelfCheckReport:
    capability: str  # torch.backends.cpu.get_cpu_capability() on CPU, the GPU's name on CUDA
    dtype: str
    checks: tuple[PathCheck, ...]
    seconds: float

    @property
    def kernels(self) -> dict[str, str]:
        """Each checked path -> the kernel it runs (``ModelInfo``)."""
        return {c.path: c.kernel for c in self.checks}


def rel_error(y: Tensor, ref: Tensor) -> float:
    """Largest per-row relative error of ``y`` against ``ref`` (rows = all but the last dim); inf if not finite."""
    y2, r2 = y.float().reshape(-1, y.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    if not bool(torch.isfinite(y2).all()):
        return math.inf
    err = (y2 - r2).norm(dim=1) / r2.norm(dim=1).clamp_min(1e-12)
    return float(err.max())


def exact_top(values: Tensor, indices: Tensor) -> Tensor:
    """[2, B] float64 of a row max and argmax, NaN and +-inf as distinct finite values: ``rel_error`` of two is 0
    only if they are equal (a check with tolerance 0)."""
    return torch.stack((values.double().nan_to_num(7e6, 8e6, -8e6), indices.double()))
