"""The adapter store: registered adapters, a device tier and a host tier with byte budgets, and a loader thread.

The budget policy (LRU order, eviction) lives in ``service.adapters.lora.tiers``; file reading and layout in
``service.adapters.lora.reader``; the loader thread and its queue in ``service.adapters.lora.loader``; this module
owns the lock, the registry and the engine protocol.

Tiers. The *device tier* holds ``LoraLayer`` objects on the serving device in the serving dtype, ``lora_B``
already scaled; the *host tier* holds the raw tensors as read from the file (pinned memory when serving on CUDA).
On a CPU server both live in CPU memory with the same meaning. Host copies are inclusive: loading from disk keeps
the raw copy (when the host budget allows), so evicting an adapter from the device tier leaves it in the host
tier and a later reuse lays it out again without touching the disk. When a tier would exceed its budget the
least recently used adapter leaves it: from the device tier only adapters with no pins; from the host tier any
host copy (the device copy, if any, stays). An adapter that is neither on the device nor in the host tier is
"registered" (disk only). The raw buffer of a disk read in progress is not counted until it joins the host tier.

Loading. ``request`` never blocks: it returns True when every layer of the adapter is resident on the device tier, and
otherwise queues one load on the loader thread and returns False (single flight: requests for an adapter already
queued or loading queue nothing). The loader makes room on the device tier first (when every resident adapter is
held: an overflow copy, outside the device budget and charged to the host budget, at most ``overflow_adapters`` of
them, each dropped when its last pin goes, see ``tiers``; past those it waits for an unpin), then
``reader.AdapterReader`` reads each touched layer's tensors with one ``service.loading.load_tensors`` call into the
host buffer (or reuses the host copy) and lays them out on the device.
The store keeps file *names*, never open handles; each per-layer read opens the adapter's one weights file and closes
it again, so the store holds at most one descriptor at a time. Every read opens
the file through ``integrity.open_verified`` (no symlink at the last component, its real path inside the roots,
unchanged since it was indexed) and every tensor read is checked finite (``integrity.check_finite``; the ``validate``
stage of the load metrics). A file changed since registration is indexed again, as a new registration would, then
loaded (or the adapter fails with the new error). A failed load marks the adapter failed: ``request`` then returns
False, ``failure`` returns the error (a ``LoraplexError``: the ``CheckpointError`` naming file and tensor,
``ResourceExhausted`` for an adapter larger than the whole device budget). It stays failed while its weights file
stays as it was; once the file changes (looked at by ``request``, at most every ``RETRY_CHECK_SECONDS``), the next
request clears the failure and loads it again, no unload needed.

Engine protocol. Call ``request(id, pin=True, waiter=row)`` each step for a waiting row: the first True pins the
adapter in the same critical section, so it cannot be evicted before the row runs; while it is False,
``failure(id)`` not None means fail the row with that error; ``unpin`` when the row retires, ``forget(id, row)``
when it gives up waiting (cancel, deadline). A load takes the pins of the rows waiting for it as it completes, so
an adapter just loaded is never evicted before its rows claim it: when the working set exceeds the device budget,
loads overflow (up to ``overflow_adapters``), then wait in FIFO order for room (an unpin) instead of evicting each
other's fresh adapters
(``loraplex_adapter_evictions_unused_total`` counts an eviction of an adapter not used since its load). ``pin``
also works on an adapter that is not resident (it then cannot be evicted once loaded). ``layer`` takes no lock
and is only valid for pinned adapters. ``unregister`` of a pinned adapter raises ``FailedPrecondition``
(finish or cancel the requests first); an unpinned adapter that is loading is dropped when the load ends. On
CUDA the engine is assumed to read adapter weights on the device's default stream: the loader copies on its own
stream, synchronises it before publishing, and marks each buffer as used by the default stream so that memory
freed by an eviction is not reused while the engine's queued kernels may still read it.

Thread safety: one lock guards all state; file reads and tensor work run outside it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from service import metrics
from service.adapters.common.files import stamp_or_none
from service.adapters.lora.loader import Loader
from service.adapters.lora.reader import DEVICE_ALIGN, HOST_ALIGN, MAX_SAVED_MODULE_BYTES, AdapterReader
from service.adapters.lora.registry import index_adapter
from service.adapters.lora.spec import plan_nbytes
from service.adapters.lora.tiers import Entry, Tiers
from service.adapters.lora.types import AdapterInfo, AdapterState, BaseWeights, LoraLayer, StoreState
from service.errors import (
    AdapterNotFound,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidAdapter,
    LoraplexError,
)
from service.model.config import ModelConfig

log = logging.getLogger(__name__)

RETRY_CHECK_SECONDS = 1.0  # a failed adapter's file is stat()ed at most this often, to retry it once it changed


class AdapterStore:
    """Registered adapters and their tiers; see the module docstring for the policy and the engine protocol."""

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        device_budget_bytes: int,
        host_budget_bytes: int,
        roots: Sequence[Path] = (),
        base: BaseWeights | None = None,
        max_saved_bytes: int = MAX_SAVED_MODULE_BYTES,
        overflow_adapters: int = 0,
    ) -> None:
        if device_budget_bytes < 0 or host_budget_bytes < 0:
            raise ValueError("adapter budgets must be >= 0 bytes")
        if overflow_adapters < 0:
            raise ValueError("overflow_adapters must be >= 0")
        self.model_config = model_config
        self.base = base  # the base weights DoRA's norms are computed from; None: DoRA adapters are refused
        self.device = torch.device(device)
        self.dtype = dtype
        self.device_budget_bytes = device_budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self.roots = tuple(Path(r) for r in roots)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._entries: dict[str, Entry] = {}
        self._tiers = Tiers(self._entries, device_budget_bytes, host_budget_bytes, overflow_adapters)
        self._reader = AdapterReader(self.device, dtype, self.roots, base, max_saved_bytes=max_saved_bytes)
        self._loader = Loader(
            self._cond,
            self._entries,
            self._tiers,
            self._reader,
            model_config=model_config,
            dtype=dtype,
            roots=self.roots,
            device_budget_bytes=device_budget_bytes,
        )
        metrics.ADAPTER_BUDGET_BYTES.labels(tier="device").set(device_budget_bytes)
        metrics.ADAPTER_BUDGET_BYTES.labels(tier="host").set(host_budget_bytes)

    # --- registry -------------------------------------------------------------------------------------------

    def register(self, adapter_id: str, path: Path) -> AdapterInfo:
        """Index an adapter (config + header only) and validate it against the base model.

        Raises ``InvalidRequest`` (bad id), ``AlreadyExists``, ``PermissionDenied`` (outside ``roots``),
        ``InvalidAdapter`` / ``HeaderError`` (a ``CheckpointError`` naming the file and tensor)."""
        with self._lock:
            if adapter_id in self._entries:
                raise AlreadyExists(f"adapter {adapter_id!r} is already registered (unload it first)")
        spec = index_adapter(adapter_id, path, self.model_config, roots=self.roots)
        if spec.config.use_dora and self.base is None:
            raise InvalidAdapter(
                "DoRA (use_dora) needs the base model's weights for its norm; this adapter store has none",
                file=spec.source / "adapter_config.json",
            )
        self._reader.check_saved(spec)  # stateless: safe beside the loader thread
        metrics.ADAPTER_LOAD_DURATION.labels(stage="index", tier="disk").observe(spec.index_seconds)
        entry = Entry(
            spec=spec,
            registered_at=time.time(),
            host_nbytes=plan_nbytes(spec, None, HOST_ALIGN),
            device_nbytes=plan_nbytes(spec, self.dtype, DEVICE_ALIGN),
        )
        with self._lock:
            if adapter_id in self._entries:
                raise AlreadyExists(f"adapter {adapter_id!r} is already registered (unload it first)")
            self._entries[adapter_id] = entry
            self._tiers.publish()
            return entry.info()

    def unregister(self, adapter_id: str) -> None:
        """Forget an adapter and free its tiers. ``FailedPrecondition`` while running requests pin it."""
        with self._cond:
            entry = self._entry(adapter_id)
            if entry.pins:
                raise FailedPrecondition(
                    f"adapter {adapter_id!r} is in use by {entry.pins} running request(s); "
                    "unload it after they finish or are cancelled"
                )
            del self._entries[adapter_id]
            self._tiers.drop_device(adapter_id, entry)
            self._tiers.drop_host(adapter_id, entry)
            self._loader.discard(adapter_id)
            self._tiers.publish()
            self._cond.notify_all()

    def get(self, adapter_id: str) -> AdapterInfo:
        with self._lock:
            return self._entry(adapter_id).info()

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [e.info() for _, e in sorted(self._entries.items())]

    def state(self) -> StoreState:
        with self._lock:
            return StoreState(
                adapters={k: e.info() for k, e in sorted(self._entries.items())},
                device_bytes=self._tiers.device_used,
                host_bytes=self._tiers.host_used,
                device_budget_bytes=self.device_budget_bytes,
                host_budget_bytes=self.host_budget_bytes,
                device_lru=tuple(self._tiers.device_lru),
                host_lru=tuple(self._tiers.host_lru),
                queued=tuple(self._loader.queue),
                disk_reads=self._loader.disk_reads,
                disk_bytes=self._loader.disk_bytes,
            )

    def overflow(self) -> tuple[tuple[str, ...], int]:
        """The adapters whose copy (or load in progress) is an overflow copy, sorted, and the bytes of the copies."""
        with self._lock:
            return tuple(sorted(self._tiers.overflow)), self._tiers.overflow_used

    # --- serving ----------------------------------------------------------------------------------------------

    def request(self, adapter_id: str, *, pin: bool = False, waiter: object | None = None) -> bool:
        """True if every layer is resident on the device tier (and, with ``pin``, pin it); else queue a load
        (unless one is queued or running) and return False.

        ``waiter`` (with ``pin``) names the calling request: while it waits, the load it waits for takes its pin
        the moment it completes, so nothing can evict the adapter before the request claims it with its next
        call (True, the pin already held). A waiter that gives up calls ``forget``.

        False also for an adapter that cannot load: ``failure(adapter_id)`` then returns why (the load's error,
        or ``ResourceExhausted`` for an adapter larger than the whole device budget, decided here, before any
        read). Raises only ``AdapterNotFound`` (never registered, or unregistered meanwhile) and ``Unavailable``
        after ``close``."""
        with self._cond:
            entry = self._entry(adapter_id)
            if entry.error is not None and not self._changed_since_failure(adapter_id, entry):
                return False
            if entry.device is not None:
                entry.hits += 1
                entry.used = True
                if waiter is not None and waiter in entry.promised:
                    entry.promised.discard(waiter)  # the pin taken for it when the load completed
                    entry.pins += 1
                elif pin:
                    entry.pins += 1
                entry.waiters.discard(waiter)
                self._tiers.touch(adapter_id, entry)
                metrics.ADAPTER_CACHE_EVENTS.labels(event="hit", tier="device").inc()
                return True
            if entry.device_nbytes > self.device_budget_bytes and not entry.revalidate:
                entry.failed_stamp = entry.spec.stamp
                entry.error = self._loader.too_large(adapter_id, entry.device_nbytes)
                self._cond.notify_all()
                return False
            if pin and waiter is not None:
                entry.waiters.add(waiter)
            self._loader.queue_load(adapter_id, entry)
            return False

    def forget(self, adapter_id: str, waiter: object) -> None:
        """A request that waited (``request(..., waiter=...)``) gives up: drop its claim, the pin taken for it if
        the load completed meanwhile, and the load itself while it is still queued (waiting for room) and no other
        request waits for it. Quiet for unknown ids and waiters."""
        with self._cond:
            entry = self._entries.get(adapter_id)
            if entry is None:
                return
            entry.waiters.discard(waiter)
            if waiter in entry.promised:
                entry.promised.discard(waiter)
                self._tiers.settle(adapter_id, entry)
                self._cond.notify_all()  # a load waiting for room may proceed
            if not entry.waiters and self._loader.discard(adapter_id):  # queued, not started, nobody waits for it
                entry.loading = False
                self._cond.notify_all()

    def _changed_since_failure(self, adapter_id: str, entry: Entry) -> bool:
        """Under the lock: whether a failed adapter's weights file changed since it failed (looked at no more
        often than ``RETRY_CHECK_SECONDS``). If so the failure is cleared and the next load re-indexes the file."""
        now = time.monotonic()
        if now - entry.checked_at < RETRY_CHECK_SECONDS:
            return False
        entry.checked_at = now
        if stamp_or_none(entry.spec.file) == entry.failed_stamp:
            return False
        log.info("event=adapter_retry adapter=%s reason=file_changed error=%s", adapter_id, entry.error)
        entry.error = None
        entry.revalidate = True
        return True

    def prefetch(self, adapter_id: str) -> None:
        """Start loading a registered adapter that is neither resident nor loading, without a hit, a miss or a
        pin: the engine calls it the moment a request arrives, so the read overlaps the decode step in flight.
        Quiet for unknown ids, failed or oversized adapters and a closed store (``request`` reports those)."""
        with self._cond:
            entry = self._entries.get(adapter_id)
            if entry is None or entry.error is not None or entry.device is not None or self._loader.closed:
                return
            # Only into free room: evicting for a request that may wait in the queue a while could evict what
            # the running batch needs next; under pressure, admission (``request``) decides.
            if self._tiers.device_used + self._tiers.device_reserved + entry.device_nbytes <= self.device_budget_bytes:
                self._loader.queue_load(adapter_id, entry)

    def failure(self, adapter_id: str) -> LoraplexError | None:
        """The error that made this adapter's load fail, or None. ``AdapterNotFound`` if not registered."""
        with self._lock:
            return self._entry(adapter_id).error

    def pin(self, adapter_id: str) -> None:
        """Hold the adapter on the device tier (refcount): a pinned adapter is never evicted or unregistered."""
        with self._lock:
            entry = self._entry(adapter_id)
            entry.pins += 1
            self._tiers.touch(adapter_id, entry)

    def unpin(self, adapter_id: str) -> None:
        with self._cond:
            entry = self._entry(adapter_id)
            if entry.pins == 0:
                raise FailedPrecondition(f"adapter {adapter_id!r} is not pinned")
            entry.pins -= 1
            self._tiers.touch(adapter_id, entry)
            if entry.pins == 0:
                self._tiers.settle(adapter_id, entry)  # an overflow copy lives only while held
                self._cond.notify_all()  # a load waiting for room may proceed

    def layer(self, adapter_id: str, layer: int) -> LoraLayer | None:
        """The device-tier weights of one layer (None: the adapter does not touch it). No lock, no allocation:
        valid only while the adapter is pinned."""
        try:
            return self._tiers.device[adapter_id][layer]
        except KeyError:
            raise FailedPrecondition(f"adapter {adapter_id!r} is not resident on the device tier") from None

    def ensure(self, adapter_id: str, *, timeout: float | None = None) -> None:
        """Block until the adapter is resident on the device tier; raise its ``failure`` if it cannot load,
        ``DeadlineExceeded`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.request(adapter_id):
            with self._cond:
                entry = self._entries.get(adapter_id)
                if entry is not None and entry.error is not None:
                    raise entry.error.fresh()
                if entry is not None and entry.loading:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise DeadlineExceeded(f"adapter {adapter_id!r} did not load within {timeout} s")
                    self._cond.wait(left)

    def close(self, timeout: float | None = None) -> None:
        """Stop the loader thread (a load in progress finishes first, waited for up to ``timeout`` seconds).
        Registered adapters stay readable."""
        self._loader.close(timeout)

    def __enter__(self) -> AdapterStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- state (under the lock) -----------------------------------------------------------------------------

    def _entry(self, adapter_id: str) -> Entry:
        entry = self._entries.get(adapter_id)
        if entry is None:
            raise AdapterNotFound(adapter_id)
        return entry


__all__ = ["AdapterInfo", "AdapterState", "AdapterStore", "StoreState"]
