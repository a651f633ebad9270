"""The streamed reader for host destinations: file bytes go from the open handle straight into tensor memory.

For a destination with the file's dtype and a dense layout (the common case, including a row block of a
fused parameter), ``os.preadv`` writes the bytes directly into the destination's storage: no intermediate
buffer, no copy of the file. Anything else (a dtype change, a strided destination) is read into a small
per-thread staging buffer, chunk by chunk, and converted from there by ``Tensor.copy_``.

The pieces of every file are handed out in file order to a small pool of worker threads (``preadv``,
``madvise`` and small ``copy_`` calls all release the GIL), so the disk sees near-sequential reads while the
cores work; a readahead thread keeps the kernel ahead of them. Fresh destination memory (``torch.empty`` never
touches it) is populated by one ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) per piece before the read, instead
of one page fault per 4 KiB page inside it; transparent huge pages are not used. Why, with figures:
bench/README.md, "Loading: what the numbers say".

Invariants: every byte of a planned tensor is written exactly once, only from the byte range its record names;
a short read is a ``HeaderError`` naming file and tensor, and the first failure stops the other workers.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from service.errors import HeaderError
from service.loading.plan import Job, Piece, host_bytes, pieces, segments
from service.torch_threads import name_os_thread, pool_thread

__all__ = ["StreamResult", "populate", "pread_into", "stream_to_host"]

CHUNK_BYTES = 16 << 20  # most bytes one read call moves
STAGE_BYTES = 8 << 20  # per-thread staging buffer for converting pieces
MIN_THREADED_BYTES = 8 << 20  # below this, threads cost more than they save
READAHEAD_BYTES = 128 << 20  # how far the kernel is asked to read ahead of the workers (0: never)
READAHEAD_WINDOW = 16 << 20
CONVERT_ELEMS = 32768  # torch's grain size: copies up to this many elements run on the calling thread
_IOV_MAX = 1024
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; EINVAL before, then we stop asking


@dataclass
class StreamResult:
    bytes_read: int = 0
    read_seconds: float = 0.0  # wall time from the first read to the last byte in place
    convert_seconds: float = 0.0  # summed over threads; overlaps read_seconds
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_convert(self, seconds: float) -> None:
        with self._lock:
            self.convert_seconds += seconds


@dataclass(frozen=True, slots=True)
class _Direct:
    fd: int
    offset: int
    views: tuple[memoryview, ...]
    spans: tuple[tuple[int, int], ...]  # (address, nbytes) of the destination memory, adjacent ones merged
    nbytes: int
    first: Piece


@dataclass(frozen=True, slots=True)
class _Staged:
    fd: int
    piece: Piece


_Item = _Direct | _Staged


def stream_to_host(files: Sequence[tuple[Path, int, list[Job]]], *, threads: int) -> StreamResult:
    """Read every job (grouped by file, each list sorted by offset; fds already open) into its destination."""
    result = StreamResult()
    total = sum(j.record.nbytes for _, _, jobs in files for j in jobs)
    items = _items(files)
    n_threads = max(1, threads) if total >= MIN_THREADED_BYTES else 1
    t0 = time.perf_counter()
    ahead = _Readahead(files) if READAHEAD_BYTES and total >= MIN_THREADED_BYTES else None
    try:
        if n_threads == 1:
            staging = _Staging()
            for item in items:
                if ahead is not None:
                    ahead.consumed(_item_bytes(item))
                _run(item, staging, result)
        else:
            _run_threaded(items, n_threads, result, ahead)
    finally:
        if ahead is not None:
            ahead.stop()
    result.read_seconds = time.perf_counter() - t0
    result.bytes_read = total
    return result


def _items(files: Sequence[tuple[Path, int, list[Job]]]) -> Iterator[_Item]:
    """Work items in file order: runs of adjacent direct pieces become one vectored read."""
    for _, fd, jobs in files:
        run: list[Piece] = []
        all_pieces = (p for job in jobs for p in pieces([job], CHUNK_BYTES if job.direct else STAGE_BYTES))
        for piece in all_pieces:
            if not piece.job.direct:
                if run:
                    yield _direct(fd, run)
                    run = []
                yield _Staged(fd, piece)
                continue
            if piece.nbytes == 0:
                continue
            if run and (
                run[-1].offset + run[-1].nbytes != piece.offset
                or sum(p.nbytes for p in run) + piece.nbytes > CHUNK_BYTES
                or len(run) >= _IOV_MAX
            ):
                yield _direct(fd, run)
                run = []
            run.append(piece)
        if run:
            yield _direct(fd, run)


def _direct(fd: int, run: list[Piece]) -> _Direct:
    views = tuple(host_bytes(p.job.dest)[p.lo : p.hi] for p in run)
    spans: list[tuple[int, int]] = []
    for p in run:
        address = p.job.dest.data_ptr() + p.lo
        if spans and spans[-1][0] + spans[-1][1] == address:
            spans[-1] = (spans[-1][0], spans[-1][1] + p.nbytes)
        else:
            spans.append((address, p.nbytes))
    return _Direct(fd, run[0].offset, views, tuple(spans), sum(p.nbytes for p in run), run[0])


class _Staging:
    """One thread's reusable staging buffer, allocated on first use."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._view: memoryview | None = None

    def get(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        if self._buf is None or self._view is None:
            self._buf = torch.empty(STAGE_BYTES, dtype=torch.uint8)  # [STAGE_BYTES]
            self._view = host_bytes(self._buf)
        return self._buf[:nbytes], self._view[:nbytes]


def _run(item: _Item, staging: _Staging, result: StreamResult) -> None:
    if isinstance(item, _Direct):
        for address, nbytes in item.spans:
            populate(address, nbytes)
        pread_into(item.fd, item.views, item.offset, item.first)
        return
    piece = item.piece
    rec, dest = piece.job.record, piece.job.dest
    itemsize = rec.torch_dtype.itemsize
    if dest.is_contiguous():
        populate(
            dest.data_ptr() + piece.lo // itemsize * dest.element_size(), piece.nbytes // itemsize * dest.element_size()
        )
    buf, view = staging.get(piece.nbytes)
    pread_into(item.fd, (view,), piece.offset, piece)
    t0 = time.perf_counter()
    src = buf.view(rec.torch_dtype)  # [piece elements]
    with torch.no_grad():
        for seg, lo, hi in segments(dest, piece.lo // itemsize, piece.hi // itemsize):
            _copy_in_slices(seg, src[lo:hi])
    result.add_convert(time.perf_counter() - t0)


def _copy_in_slices(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (src flat, same numel) in slices small enough that torch runs each on this thread.

    A copy_ above torch's grain size opens an OpenMP parallel region; from several reader threads at once
    that oversubscribes the cores, and on a busy machine each region can wait a whole scheduler tick.
    """
    n = dst.numel()
    if n <= CONVERT_ELEMS or dst.dim() == 0:
        dst.copy_(src.view(dst.shape))
    elif dst.dim() == 1:
        for lo in range(0, n, CONVERT_ELEMS):
            dst[lo : lo + CONVERT_ELEMS].copy_(src[lo : lo + CONVERT_ELEMS])
    else:
        inner = n // dst.shape[0]  # elements per row of dim 0
        if inner > CONVERT_ELEMS:
            for r in range(dst.shape[0]):
                _copy_in_slices(dst[r], src[r * inner : (r + 1) * inner])
        else:
            rows = CONVERT_ELEMS // inner
            for r0 in range(0, dst.shape[0], rows):
                block = dst[r0 : r0 + rows]
                block.copy_(src[r0 * inner : r0 * inner + block.numel()].view(block.shape))


def _item_bytes(item: _Item) -> int:
    return item.nbytes if isinstance(item, _Direct) else item.piece.nbytes


class _Readahead:
    """Keeps the kernel reading up to ``READAHEAD_BYTES`` ahead of the workers, by ``POSIX_FADV_WILLNEED``
    on the planned byte ranges in the order the workers take them: interleaved readers defeat the kernel's
    own sequential detection, and a cold disk wants many requests in flight."""

    def __init__(self, files: Sequence[tuple[Path, int, list[Job]]]) -> None:
        self._ranges: list[tuple[int, int, int]] = []  # (fd, start, end), merged, in file order
        for _, fd, jobs in files:
            for job in jobs:
                start, end = job.record.start, job.record.start + job.record.nbytes
                if self._ranges and self._ranges[-1][0] == fd and self._ranges[-1][2] == start:
                    self._ranges[-1] = (fd, self._ranges[-1][1], end)
                elif end > start:
                    self._ranges.append((fd, start, end))
        self._cond = threading.Condition()
        self._taken = 0  # bytes handed to workers so far
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="loraplex-readahead", daemon=True)
        self._thread.start()

    def consumed(self, nbytes: int) -> None:
        with self._cond:
            self._taken += nbytes
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        name_os_thread()
        issued = 0
        for fd, start, end in self._ranges:
            for lo in range(start, end, READAHEAD_WINDOW):
                n = min(READAHEAD_WINDOW, end - lo)
                with self._cond:
                    while not self._stopped and issued - self._taken >= READAHEAD_BYTES:
                        self._cond.wait()
                    if self._stopped:
                        return
                try:
                    os.posix_fadvise(fd, lo, n, os.POSIX_FADV_WILLNEED)
                except OSError:
                    return  # advice only; the reads themselves will report real errors
                issued += n


def _run_threaded(items: Iterator[_Item], n_threads: int, result: StreamResult, ahead: _Readahead | None) -> None:
    """``n_threads`` pool workers drain ``items`` in file order, each with its own staging buffer; the first
    failure stops the others after their current item and is raised here."""
    lock = threading.Lock()  # guards ``items``: a generator is not thread-safe
    failed = threading.Event()

    def drain() -> None:
        staging = _Staging()
        while not failed.is_set():
            with lock:
                item = next(items, None)
            if item is None:
                return
            if ahead is not None:
                ahead.consumed(_item_bytes(item))
            try:
                _run(item, staging, result)
            except BaseException:
                failed.set()
                raise

    with ThreadPoolExecutor(n_threads, thread_name_prefix="loraplex-load", initializer=pool_thread) as pool:
        workers = [pool.submit(drain) for _ in range(n_threads)]
        done, _ = wait(workers, return_when=FIRST_EXCEPTION)
    for future in (*done, *workers):  # the failures that stopped the pool first, then any later one
        future.result()


def pread_into(fd: int, views: Sequence[memoryview], offset: int, piece: Piece) -> None:
    """Fill ``views`` with the file bytes at ``offset`` (retrying short reads); EOF is a typed error."""
    pending = [v for v in views if len(v)]
    while pending:
        n = os.preadv(fd, pending, offset)
        if n == 0:
            raise HeaderError(
                f"file ended at byte {offset}, inside the tensor's data (truncated after its header was read?)",
                file=piece.job.record.file,
                tensor=piece.job.record.name,
            )
        offset += n
        while n and pending:
            head = pending[0]
            if n >= len(head):
                n -= len(head)
                pending.pop(0)
            else:
                pending[0] = head[n:]
                n = 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_populate_supported = [hasattr(os, "preadv") and os.uname().sysname == "Linux"]


def populate(address: int, nbytes: int) -> None:
    """Fault in the whole pages inside [address, address + nbytes) for writing, in one system call (best
    effort: pages already present are left alone; partial edge pages fault normally later)."""
    if not _populate_supported[0] or nbytes < 2 * mmap.PAGESIZE:
        return
    libc = _libc()
    if libc is None:
        _populate_supported[0] = False
        return
    page = mmap.PAGESIZE
    lo = (address + page - 1) // page * page
    hi = (address + nbytes) // page * page
    if hi > lo and libc.madvise(lo, hi - lo, _MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
        _populate_supported[0] = False  # kernel too old for MADV_POPULATE_WRITE
