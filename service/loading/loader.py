"""``load_tensors``: validate a load plan against a checkpoint, then fill every destination tensor.

Validation happens before a single data byte is read: every planned name must exist, shapes must match,
dtypes must be convertible, every file must still be as long as its header says, and (if asked) every
checkpoint tensor must be planned. Each failure names all offending tensors and their files.

Three modes reach the same destinations: ``stream`` (ours; ``stream.py`` for host memory, ``cuda.py`` for
devices), and two references kept only to compare against: ``mmap`` (``safetensors.safe_open``, then copy)
and ``eager`` (read each file into bytes, ``safetensors.torch.load``, then copy).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from service.errors import HeaderError, TensorMismatch
from service.loading.header import TensorRecord
from service.loading.index import CheckpointIndex
from service.loading.plan import Job

__all__ = ["LoadMode", "LoadStats", "check_plan", "load_tensors"]

LoadMode = Literal["stream", "mmap", "eager"]


@dataclass
class LoadStats:
    """Where the time of one ``load_tensors`` call went.

    ``header_seconds`` counts header parsing done inside the call (the ``mmap``/``eager`` references parse
    headers themselves; ``stream`` uses the records it was given, so 0). ``read_seconds`` is the wall time
    of moving the bytes into place; ``convert_seconds`` is the part of the work spent converting dtypes or
    copying out of staging/reference tensors (in ``stream`` it is summed over threads and overlaps reading).
    """

    mode: str
    header_seconds: float
    read_seconds: float
    convert_seconds: float
    total_seconds: float
    bytes_read: int
    tensors: int


def load_tensors(
    source: CheckpointIndex | Mapping[str, TensorRecord],
    plan: Mapping[str, torch.Tensor],
    *,
    mode: LoadMode = "stream",
    unexpected: Literal["error", "ignore"] = "ignore",
    ignore_unexpected: Collection[str] = (),
    threads: int = 0,
    opener: Callable[[Path], int] | None = None,
) -> LoadStats:
    """Fill each ``plan[name]`` (any dtype/device, possibly a view such as rows of a fused parameter; same
    shape as the record) with checkpoint tensor ``name``. ``unexpected="error"`` makes checkpoint tensors
    absent from the plan an error, except names equal to or fully matching a pattern of
    ``ignore_unexpected``. ``threads``: host reader threads (0 = up to 4, one per core). ``opener(file)``
    returns a read-only descriptor for ``file`` (default ``os.open``); ``stream`` mode reads through it, so a
    caller can check the opened file itself (``fstat``, its real path) before any byte is read."""
    t0 = time.perf_counter()
    if mode not in ("stream", "mmap", "eager"):
        raise ValueError(f"mode must be 'stream', 'mmap' or 'eager', got {mode!r}")
    records = source.tensors if isinstance(source, CheckpointIndex) else source
    where = source.root if isinstance(source, CheckpointIndex) else None
    jobs = _validate(records, plan, unexpected, ignore_unexpected, where)
    by_file: dict[Path, list[Job]] = {}
    for job in sorted(jobs, key=lambda j: (str(j.record.file), j.record.start)):
        by_file.setdefault(job.record.file, []).append(job)

    if mode == "stream":
        header, read, convert, nbytes = 0.0, *_load_stream(by_file, threads, opener)
    else:
        header, read, convert, nbytes = _load_reference(by_file, mode)
    return LoadStats(
        mode=mode,
        header_seconds=header,
        read_seconds=read,
        convert_seconds=convert,
        total_seconds=time.perf_counter() - t0,
        bytes_read=nbytes,
        tensors=len(jobs),
    )


def check_plan(
    source: CheckpointIndex,
    plan: Mapping[str, torch.Tensor],
    *,
    unexpected: Literal["error", "ignore"] = "ignore",
    ignore_unexpected: Collection[str] = (),
) -> None:
    """Validate ``plan`` exactly as ``load_tensors`` does, reading no data; a destination may also be a ``meta``
    tensor (its shape and dtype only), for a caller that fills it later in pieces (quantized projections)."""
    _validate(source.tensors, plan, unexpected, ignore_unexpected, source.root, devices=("cpu", "cuda", "meta"))


def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    if src == dst:
        return True
    if src.is_complex or dst.is_complex or torch.bool in (src, dst):
        return False
    return src.is_floating_point == dst.is_floating_point  # float <-> float, int <-> int


def _validate(
    records: Mapping[str, TensorRecord],
    plan: Mapping[str, torch.Tensor],
    unexpected: str,
    ignore_unexpected: Collection[str],
    where: Path | None,
    devices: tuple[str, ...] = ("cpu", "cuda"),
) -> list[Job]:
    missing = sorted(name for name in plan if name not in records)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:50]) + (" ..." if len(missing) > 50 else "")
        raise TensorMismatch(
            f"{len(missing)} planned tensor(s) not in the checkpoint: {shown}",
            file=where,
            tensor=missing[0] if len(missing) == 1 else None,
        )
    problems: list[tuple[TensorRecord, str]] = []
    jobs: list[Job] = []
    for name, dest in plan.items():
        rec = records[name]
        if tuple(dest.shape) != rec.shape:
            problems.append((rec, f"shape {rec.shape} in the file, {tuple(dest.shape)} in the plan"))
        elif not _convertible(rec.torch_dtype, dest.dtype):
            problems.append((rec, f"dtype {rec.dtype} cannot be converted to {dest.dtype}"))
        elif dest.device.type not in devices:
            problems.append((rec, f"destination device {dest.device} is not supported"))
        else:
            jobs.append(Job(rec, dest))
    if problems:
        if len(problems) == 1:
            rec, msg = problems[0]
            raise TensorMismatch(msg, file=rec.file, tensor=rec.name)
        detail = "; ".join(f"{rec.name!r} ({rec.file}): {msg}" for rec, msg in problems)
        raise TensorMismatch(f"{len(problems)} tensors do not fit the plan: {detail}", file=where)
    if unexpected == "error":
        patterns = [re.compile(p) for p in ignore_unexpected]
        names = set(ignore_unexpected)
        extra = sorted(
            n for n in records if n not in plan and n not in names and not any(p.fullmatch(n) for p in patterns)
        )
        if extra:
            shown = ", ".join(f"{n!r} ({records[n].file})" for n in extra[:50]) + (" ..." if len(extra) > 50 else "")
            raise TensorMismatch(
                f"{len(extra)} checkpoint tensor(s) not in the plan: {shown}",
                file=where,
                tensor=extra[0] if len(extra) == 1 else None,
            )
    elif unexpected != "ignore":
        raise ValueError(f"unexpected must be 'error' or 'ignore', got {unexpected!r}")
    return jobs


def _open_checked(file: Path, jobs: list[Job], opener: Callable[[Path], int] | None = None) -> int:
    """Open a file for reading and check it still holds every planned byte range (before reading any)."""
    try:
        fd = opener(file) if opener is not None else os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise HeaderError(f"cannot open: {e}", file=file) from e
    size = os.fstat(fd).st_size
    last = max(jobs, key=lambda j: j.record.start + j.record.nbytes)
    if last.record.start + last.record.nbytes > size:
        os.close(fd)
        raise HeaderError(
            f"file has {size} bytes but the tensor's data ends at byte {last.record.start + last.record.nbytes} "
            "(truncated or changed since its header was read)",
            file=file,
            tensor=last.record.name,
        )
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd


def _load_stream(
    by_file: dict[Path, list[Job]], threads: int, opener: Callable[[Path], int] | None
) -> tuple[float, float, int]:
    from service.loading.stream import stream_to_host

    fds: list[tuple[Path, int, list[Job]]] = []
    try:
        for file, jobs in by_file.items():
            fds.append((file, _open_checked(file, jobs, opener), jobs))
        host = [(f, fd, [j for j in jobs if j.dest.device.type == "cpu"]) for f, fd, jobs in fds]
        dev = [(f, fd, [j for j in jobs if j.dest.device.type == "cuda"]) for f, fd, jobs in fds]
        n_threads = threads if threads > 0 else min(4, os.cpu_count() or 1)
        res = stream_to_host([h for h in host if h[2]], threads=n_threads)
        read, convert, nbytes = res.read_seconds, res.convert_seconds, res.bytes_read
        if any(d[2] for d in dev):
            from service.loading.cuda import stream_to_cuda

            dres = stream_to_cuda([d for d in dev if d[2]])
            read += dres.read_seconds
            convert += dres.convert_seconds
            nbytes += dres.bytes_read
        return read, convert, nbytes
    finally:
        for _, fd, _ in fds:
            os.close(fd)


def _load_reference(by_file: dict[Path, list[Job]], mode: str) -> tuple[float, float, float, int]:
    """The comparison modes: safetensors' own readers, then a copy into each destination."""
    import safetensors
    import safetensors.torch

    header = read = convert = 0.0
    nbytes = 0
    for file, jobs in by_file.items():
        t0 = time.perf_counter()
        if mode == "mmap":
            with safetensors.safe_open(str(file), framework="pt", device="cpu") as f:
                t1 = time.perf_counter()
                tensors = {j.record.name: f.get_tensor(j.record.name) for j in jobs}
        else:
            data = file.read_bytes()
            t1 = time.perf_counter()
            tensors = safetensors.torch.load(data)
        t2 = time.perf_counter()
        with torch.no_grad():
            for j in jobs:
                j.dest.copy_(tensors[j.record.name])
        t3 = time.perf_counter()
        del tensors
        header += t1 - t0 if mode == "mmap" else 0.0
        read += (t2 - t1) + (t1 - t0 if mode == "eager" else 0.0)
        convert += t3 - t2
        nbytes += sum(j.record.nbytes for j in jobs) if mode == "mmap" else os.path.getsize(file)
    return header, read, convert, nbytes
