"""The adapter store's loader thread: a FIFO of adapters to load, each read, laid out and published in turn.

``Loader`` shares the store's lock (a ``threading.Condition``), its entries and its tiers; every method documented
"under the lock" expects the caller to hold it, and file reads and tensor work (``AdapterReader.load``,
re-indexing a changed file) run outside it. One load runs at a time: the loader reserves device room for the head
of the queue (an overflow copy's room when every resident adapter is held, ``tiers.Tiers.reserve``; it waits for an
unpin when the overflow is full too), reads it, then commits it to the tiers and hands its pins to the rows that
waited. A file changed since it was indexed is indexed again (at most ``MAX_REVALIDATIONS`` times during one load)
and its load queued anew at the front; any other error fails the adapter. The thread starts with the first queued
load and ends at ``close``; it never raises.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from service import metrics
from service.adapters.common.files import AdapterFileChanged, FileStamp, stamp_or_none
from service.adapters.lora.reader import DEVICE_ALIGN, HOST_ALIGN, AdapterReader, Loaded
from service.adapters.lora.registry import index_adapter
from service.adapters.lora.spec import AdapterSpec, plan_nbytes
from service.adapters.lora.tiers import Entry, Tiers
from service.errors import InvalidAdapter, LoraplexError, ResourceExhausted, Unavailable
from service.model.config import ModelConfig
from service.torch_threads import serial_torch

log = logging.getLogger("service.adapters.lora.store")

MAX_REVALIDATIONS = 2  # re-indexings of a file that keeps changing during one load before the load gives up


class Loader:
    """The queue of loads and the thread that runs them, over the store's lock, entries and tiers."""

    def __init__(
        self,
        cond: threading.Condition,
        entries: dict[str, Entry],
        tiers: Tiers,
        reader: AdapterReader,
        *,
        model_config: ModelConfig,
        dtype: torch.dtype,
        roots: Sequence[Path],
        device_budget_bytes: int,
    ) -> None:
        self._cond = cond
        self._entries = entries
        self._tiers = tiers
        self._reader = reader  # used by the loader thread only
        self.model_config = model_config
        self.dtype = dtype
        self.roots = tuple(roots)
        self.device_budget_bytes = device_budget_bytes
        self.queue: deque[str] = deque()
        self.closed = False
        self.disk_reads = 0
        self.disk_bytes = 0
        self._thread: threading.Thread | None = None

    def queue_load(self, adapter_id: str, entry: Entry) -> bool:
        """Under the lock: queue ``entry``'s load unless one is queued or running; True if it queued one."""
        if self.closed:
            raise Unavailable("the adapter store is closed")
        if entry.loading:
            return False
        entry.loading = True
        entry.queued_at = time.perf_counter()
        self.queue.append(adapter_id)
        metrics.ADAPTER_CACHE_EVENTS.labels(event="miss", tier="device").inc()
        self._start()
        self._cond.notify_all()
        return True

    def discard(self, adapter_id: str) -> bool:
        """Under the lock: drop a queued (not started) load; True if there was one."""
        if adapter_id in self.queue:
            self.queue.remove(adapter_id)
            return True
        return False

    def too_large(self, adapter_id: str, device_nbytes: int) -> ResourceExhausted:
        return ResourceExhausted(
            f"adapter {adapter_id!r} needs {device_nbytes} bytes on the device, more than the whole adapter device "
            f"budget of {self.device_budget_bytes} bytes (--adapter-device-budget)"
        )

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread (a load in progress finishes first; waited for up to ``timeout`` seconds, a daemon after
        that); later ``queue_load`` calls raise ``Unavailable``."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # --- the thread -------------------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="loraplex-adapter-loader", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        serial_torch()  # only the engine thread runs parallel kernels (service.torch_threads)
        while True:
            with self._cond:
                job = self._next_job()
                if job is None:
                    return
                adapter_id, entry = job
                host = entry.host
                revalidate = entry.revalidate
            if revalidate:  # no room was reserved: its size is known once it is indexed again
                self._revalidate(adapter_id, entry)
                continue
            try:
                loaded = self._reader.load(entry.spec, host)
            except Exception as e:  # the loader must survive anything; the rows waiting get the error
                self._failed(adapter_id, entry, e)
                continue
            with self._cond:
                self._commit(adapter_id, entry, loaded)
                self._cond.notify_all()

    def _failed(self, adapter_id: str, entry: Entry, e: Exception) -> None:
        """Outside the lock: a read raised ``e``; release its room, then index the file again or fail the load."""
        with self._cond:
            self._tiers.end_load(adapter_id, entry, None)
        if isinstance(e, AdapterFileChanged):  # replaced or rewritten since it was indexed: index it again
            log.info("event=adapter_file_changed adapter=%s detail=%s", adapter_id, e)
            if entry.revalidations < MAX_REVALIDATIONS:
                entry.revalidations += 1
                self._revalidate(adapter_id, entry)
            else:
                self._fail_load(adapter_id, entry, e, stamp_or_none(entry.spec.file))
            return
        error = e if isinstance(e, LoraplexError) else _wrap(e, entry.spec)
        if not isinstance(e, LoraplexError):
            log.exception("event=adapter_load_error adapter=%s", adapter_id)
        self._fail_load(adapter_id, entry, error, entry.spec.stamp)  # the failure belongs to that version

    def _fail_load(self, adapter_id: str, entry: Entry, error: LoraplexError, seen: FileStamp | None) -> None:
        """Outside the lock (its room already released): end a load in failure; ``seen`` is the file version it
        failed on (a later request retries once the file differs from it)."""
        with self._cond:
            entry.loading = False
            entry.revalidate = False
            entry.revalidations = 0
            entry.error = error
            entry.failed_stamp = seen
            entry.checked_at = time.monotonic()
            self._cond.notify_all()
        log.warning("event=adapter_load_failed adapter=%s error=%s", adapter_id, error)

    def _revalidate(self, adapter_id: str, entry: Entry) -> None:
        """Outside the lock, holding no room: index a changed adapter folder again, as a new registration would.
        On success the entry takes the new index (and a new ``registered_at``: its weights, so its K/V, may
        differ) and its load is queued again at the front; otherwise the adapter fails with the new error."""
        seen = stamp_or_none(entry.spec.file)
        try:
            spec = index_adapter(adapter_id, entry.spec.source, self.model_config, roots=self.roots)
        except LoraplexError as e:
            self._fail_load(adapter_id, entry, e, seen)
            return
        metrics.ADAPTER_LOAD_DURATION.labels(stage="index", tier="disk").observe(spec.index_seconds)
        device_nbytes = plan_nbytes(spec, self.dtype, DEVICE_ALIGN)
        if device_nbytes > self.device_budget_bytes:
            self._fail_load(adapter_id, entry, self.too_large(adapter_id, device_nbytes), spec.stamp)
            return
        with self._cond:
            entry.loading = entry.revalidate = False
            if self._entries.get(adapter_id) is not entry or self.closed:
                self._cond.notify_all()
                return
            self._tiers.drop_host(adapter_id, entry)  # raw bytes of the old version
            entry.spec, entry.registered_at = spec, time.time()
            entry.host_nbytes = plan_nbytes(spec, None, HOST_ALIGN)
            entry.device_nbytes = device_nbytes
            if self.queue_load(adapter_id, entry):
                self.queue.remove(adapter_id)
                self.queue.appendleft(adapter_id)  # it was at the head already
            self._cond.notify_all()
        log.info("event=adapter_revalidated adapter=%s bytes=%d", adapter_id, spec.file_bytes)

    def _next_job(self) -> tuple[str, Entry] | None:
        """Under the lock: the next adapter to load with device room reserved for it (waits as needed)."""
        while True:
            if self.closed:
                return None
            if not self.queue:
                self._cond.wait()
                continue
            adapter_id = self.queue[0]
            entry = self._entries.get(adapter_id)
            if entry is None or not entry.loading:
                self.queue.popleft()
                continue
            if entry.revalidate:  # indexed again first; its load is queued anew with its new size
                self.queue.popleft()
                return adapter_id, entry
            if not self._tiers.reserve(adapter_id, entry):
                self._cond.wait()  # every resident adapter is held, the overflow full: wait for an unpin or unregister
                continue
            self.queue.popleft()
            return adapter_id, entry

    def _commit(self, adapter_id: str, entry: Entry, loaded: Loaded) -> None:
        """Under the lock: publish a finished load (or drop it if the adapter was unregistered meanwhile)."""
        entry.loading = False
        if self._entries.get(adapter_id) is not entry:
            self._tiers.end_load(adapter_id, entry, None)
            return
        total = time.perf_counter() - entry.queued_at
        entry.revalidations = 0
        entry.promised |= entry.waiters  # pinned for the requests that waited, before anything can evict it
        entry.waiters.clear()
        entry.used = False  # until a request gets it
        self._tiers.end_load(adapter_id, entry, loaded.layers)
        entry.loads += 1
        entry.read_seconds, entry.layout_seconds, entry.total_seconds = (
            loaded.read_seconds,
            loaded.layout_seconds,
            total,
        )
        tier = "disk" if loaded.from_disk else "host"
        if loaded.from_disk:
            self._count_disk_read(adapter_id, entry, loaded)
        else:
            metrics.ADAPTER_CACHE_EVENTS.labels(event="hit", tier="host").inc()
        metrics.ADAPTER_LOAD_DURATION.labels(stage="layout", tier=tier).observe(loaded.layout_seconds)
        metrics.ADAPTER_LOAD_DURATION.labels(stage="total", tier=tier).observe(total)
        metrics.ADAPTERS.loaded(adapter_id, total)
        self._tiers.touch(adapter_id, entry)
        self._tiers.publish()
        log.info(
            "event=adapter_loaded adapter=%s from=%s read_s=%.4f layout_s=%.4f total_s=%.4f bytes=%d",
            adapter_id,
            tier,
            loaded.read_seconds,
            loaded.layout_seconds,
            total,
            entry.device_nbytes,
        )

    def _count_disk_read(self, adapter_id: str, entry: Entry, loaded: Loaded) -> None:
        """Under the lock: account a load read from disk, and keep its raw copy in the host tier if it fits."""
        entry.disk_reads += 1
        entry.disk_bytes += loaded.bytes_read
        self.disk_reads += 1
        self.disk_bytes += loaded.bytes_read
        metrics.ADAPTER_READ_BYTES.inc(loaded.bytes_read)
        metrics.ADAPTER_CACHE_EVENTS.labels(event="miss", tier="host").inc()
        metrics.ADAPTER_LOAD_DURATION.labels(stage="read", tier="disk").observe(loaded.read_seconds)
        if self._tiers.make_host_room(loaded.host.nbytes, adapter_id):
            entry.host = loaded.host
            self._tiers.host_used += loaded.host.nbytes


def _wrap(error: Exception, spec: AdapterSpec) -> LoraplexError:
    if isinstance(error, OSError):
        return InvalidAdapter(f"cannot read the adapter weights: {error}", file=spec.file)
    return LoraplexError(f"loading adapter {spec.id!r} failed: {type(error).__name__}: {error}")


__all__ = ["MAX_REVALIDATIONS", "Loader"]
