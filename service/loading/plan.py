"""Read plans: which byte ranges of which files go to which destination elements, in file order.

Shared by the CPU and CUDA readers. A ``Job`` pairs one record with its destination; ``pieces`` splits
jobs into ``Piece``s no larger than a chunk (whole elements, so a staged piece converts on its own), sorted
by file offset so every file is read front to back. ``segments`` maps a flat element range onto views of a
(possibly non-contiguous) destination, which is how staged bytes reach fused slices and strided tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from service.loading.header import TensorRecord

__all__ = ["Job", "Piece", "byte_view", "host_bytes", "pieces", "segments"]


@dataclass(frozen=True, slots=True)
class Job:
    record: TensorRecord
    dest: torch.Tensor  # same shape as the record; any dtype, any strides

    @property
    def direct(self) -> bool:
        """Bytes can land in the destination as they are: same dtype, one dense block of host memory."""
        return (
            self.dest.device.type == "cpu" and self.dest.dtype == self.record.torch_dtype and self.dest.is_contiguous()
        )


@dataclass(frozen=True, slots=True)
class Piece:
    job: Job
    offset: int  # absolute file offset of the piece's first byte
    lo: int  # byte range [lo, hi) within the tensor
    hi: int

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def pieces(jobs: list[Job], chunk_bytes: int) -> Iterator[Piece]:
    """Split jobs (sorted by file offset) into pieces of at most ``chunk_bytes`` (rounded to elements)."""
    for job in jobs:
        rec = job.record
        step = max(64, chunk_bytes - chunk_bytes % 64)  # a multiple of every itemsize
        for lo in range(0, rec.nbytes, step):
            hi = min(rec.nbytes, lo + step)
            yield Piece(job, rec.start + lo, lo, hi)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor, as a flat uint8 view of the same memory. # [numel*itemsize]"""
    flat = t.detach().reshape(-1)  # a view: t is contiguous
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def host_bytes(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous host tensor's bytes (no copy)."""
    return byte_view(t).numpy().data


def segments(t: torch.Tensor, a: int, b: int) -> list[tuple[torch.Tensor, int, int]]:
    """Views of ``t`` covering its flat (row-major) elements [a, b), as (view, lo, hi) with lo/hi relative to
    a: ``view.copy_(src[lo:hi].view(view.shape))`` writes source elements a+lo..a+hi-1 into place."""
    out: list[tuple[torch.Tensor, int, int]] = []
    _segments(t.detach(), a, b, 0, out)
    return out


def _segments(t: torch.Tensor, a: int, b: int, base: int, out: list[tuple[torch.Tensor, int, int]]) -> None:
    if a >= b:
        return
    if t.is_contiguous():
        out.append((t.reshape(-1)[a:b], base, base + b - a))
        return
    if t.dim() == 1:
        out.append((t[a:b], base, base + b - a))
        return
    inner = math.prod(t.shape[1:])  # elements per row of dim 0
    pos = a
    if pos % inner:  # partial first row
        row = pos // inner
        end = min(b, (row + 1) * inner)
        _segments(t[row], pos - row * inner, end - row * inner, base + pos - a, out)
        pos = end
    full_end = (b // inner) * inner
    if full_end > pos:  # whole rows, one strided view
        out.append((t[pos // inner : full_end // inner], base + pos - a, base + full_end - a))
        pos = full_end
    if b > pos:  # partial last row
        row = pos // inner
        _segments(t[row], 0, b - pos, base + pos - a, out)
