"""The streamed reader for CUDA destinations: file -> reused pinned buffers -> device, overlapped.

A few pinned host buffers (allocated once per load) take turns: the host thread reads the next pieces of
the file into a free buffer while earlier buffers are being copied to the device by ``non_blocking`` copies
on a side stream. An event recorded after each buffer's copies tells when that buffer may be refilled.
Pieces whose destination has the file's dtype and is dense are copied byte for byte; the others land in a
device staging buffer first and are converted there (on the device, by ``copy_``), so the host never
converts anything. The side stream waits for the caller's stream before starting (destinations may have
been allocated on it), and the caller's stream waits for the side stream at the end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from service.loading.plan import Job, Piece, byte_view, host_bytes, pieces, segments
from service.loading.stream import pread_into

__all__ = ["CudaResult", "stream_to_cuda"]

BUFFER_BYTES = 64 << 20
N_BUFFERS = 3
_ALIGN = 256  # bytes; keeps every piece's start aligned for any dtype view


@dataclass
class CudaResult:
    bytes_read: int = 0
    read_seconds: float = 0.0
    convert_seconds: float = 0.0  # host time spent enqueueing copies/conversions


def _is_direct(job: Job) -> bool:
    return job.dest.dtype == job.record.torch_dtype and job.dest.is_contiguous()


def stream_to_cuda(files: Sequence[tuple[Path, int, list[Job]]]) -> CudaResult:
    """Read every job (grouped by file, sorted by offset; destinations on one or more CUDA devices)."""
    result = CudaResult()
    by_device: dict[torch.device, list[tuple[Path, int, list[Job]]]] = {}
    for file, fd, jobs in files:
        for job in jobs:
            by_device.setdefault(job.dest.device, [])
        for device in {j.dest.device for j in jobs}:
            by_device[device].append((file, fd, [j for j in jobs if j.dest.device == device]))
    for device, dev_files in by_device.items():
        _stream_device(device, dev_files, result)
    return result


def _stream_device(device: torch.device, files: list[tuple[Path, int, list[Job]]], result: CudaResult) -> None:
    total = sum(j.record.nbytes for _, _, jobs in files for j in jobs)
    if total == 0:
        return
    size = min(BUFFER_BYTES, _round_up(total + _ALIGN, _ALIGN))
    n_bufs = min(N_BUFFERS, max(1, -(-total // size)))
    pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(n_bufs)]  # [size] each
    views = [host_bytes(p) for p in pinned]
    needs_stage = any(not _is_direct(j) for _, _, jobs in files for j in jobs)
    staged = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(n_bufs)] if needs_stage else []
    events: list[torch.cuda.Event | None] = [None] * n_bufs
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    caller = torch.cuda.current_stream(device)
    side.wait_stream(caller)

    t0 = time.perf_counter()
    k = 0  # which buffer fills next
    batch: list[tuple[Piece, int]] = []  # (piece, offset in the buffer)
    fill = 0

    def flush() -> None:
        nonlocal k, batch, fill
        if not batch:
            return
        i = k % n_bufs
        t1 = time.perf_counter()
        events[i] = _enqueue(batch, pinned[i], staged[i] if staged else None, side)
        result.convert_seconds += time.perf_counter() - t1
        k += 1
        batch, fill = [], 0

    def buffer_for_next() -> int:
        i = k % n_bufs
        ev = events[i]
        if ev is not None:
            ev.synchronize()  # its previous copies are done: safe to overwrite
            events[i] = None
        return i

    for _, fd, jobs in files:
        for piece in pieces(jobs, size - _ALIGN):
            if piece.nbytes == 0:
                continue
            if fill + piece.nbytes > size:
                flush()
            i = buffer_for_next()
            pread_into(fd, (views[i][fill : fill + piece.nbytes],), piece.offset, piece)
            batch.append((piece, fill))
            fill = _round_up(fill + piece.nbytes, _ALIGN)
    flush()
    caller.wait_stream(side)
    side.synchronize()
    result.read_seconds += time.perf_counter() - t0
    result.bytes_read += total


def _enqueue(
    batch: list[tuple[Piece, int]], pinned: torch.Tensor, staged: torch.Tensor | None, side: torch.cuda.Stream
) -> torch.cuda.Event:
    """Queue on ``side`` the copies out of one filled pinned buffer: bytes as they are into dense same-dtype
    destinations, the others through ``staged`` (same size, on the device) and a conversion there. The returned
    event fires once ``pinned`` may be refilled."""
    with torch.cuda.stream(side), torch.no_grad():
        for piece, at in batch:
            host = pinned[at : at + piece.nbytes]  # [piece bytes], pinned
            rec, dest = piece.job.record, piece.job.dest
            if _is_direct(piece.job):
                byte_view(dest)[piece.lo : piece.hi].copy_(host, non_blocking=True)
                continue
            if staged is None:
                raise RuntimeError("a converting piece without a device staging buffer")  # a bug: planned above
            raw = staged[at : at + piece.nbytes]  # [piece bytes] on the device
            raw.copy_(host, non_blocking=True)
            src = raw.view(rec.torch_dtype)  # [piece elements]
            itemsize = rec.torch_dtype.itemsize
            for seg, lo, hi in segments(dest, piece.lo // itemsize, piece.hi // itemsize):
                seg.copy_(src[lo:hi].view(seg.shape))  # dtype conversion on the device
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(side)
    return event


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
