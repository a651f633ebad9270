"""The adapter store's tiers: byte budgets, LRU order and eviction over the device and host copies.

``Tiers`` is pure bookkeeping over the store's entries: which adapters are resident in which tier, how many bytes
each tier holds (plus the device room reserved for the load in progress), and which adapter leaves a tier over
budget (least recently used; from the device tier only adapters no request holds). Every method runs under the
store's lock; nothing here reads files or waits. ``device`` is the one map read without the lock (by
``AdapterStore.layer`` on the engine thread, for pinned adapters only).

Overflow. When every adapter on the device tier is held, a load may still proceed as an *overflow* copy: laid out
like any device copy but outside the device budget, its bytes charged to the host budget instead (which evicts host
copies for it) and at most ``overflow_limit`` of them at a time. It exists only while held: the moment its last pin
or promise goes (or, for one loaded for no request, at the next load's reservation) it is dropped, its host copy
kept. It is never promoted into device room that frees later. So the device budget always holds, the host budget
holds for raw and overflow bytes together, and ``overflow_limit`` 0 restores waiting for an unpin.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from service import metrics
from service.adapters.common.files import FileStamp
from service.adapters.lora.reader import HostCopy
from service.adapters.lora.spec import AdapterSpec
from service.adapters.lora.types import AdapterInfo, AdapterState, LoraLayer
from service.errors import LoraplexError

log = logging.getLogger("service.adapters.lora.store")


@dataclass(eq=False)
class Entry:
    """One registered adapter's state (the store's lock guards every field)."""

    spec: AdapterSpec
    registered_at: float
    host_nbytes: int  # size of the host-tier buffer (raw tensors, 64-byte aligned)
    device_nbytes: int  # size of the device-tier buffer (laid out, serving dtype, 256-byte aligned)
    host: HostCopy | None = None
    device: tuple[LoraLayer | None, ...] | None = None  # indexed by layer
    loading: bool = False
    error: LoraplexError | None = None
    failed_stamp: FileStamp | None = None  # the weights file when the load failed (None: it could not be stat()ed)
    checked_at: float = 0.0  # monotonic time of the last look for a changed file of a failed adapter
    revalidate: bool = False  # re-index the file before the next load (it changed since it was indexed)
    revalidations: int = 0  # re-indexings during the current load (a file that keeps changing gives up)
    pins: int = 0
    overflow: bool = False  # its device copy (or the load in progress) is outside the device budget (see above)
    evictions: int = 0  # times it left the device tier to make room for another
    shown: tuple[int, int] = (0, 0)  # (device, host) bytes last added to its per-adapter residency gauge
    waiters: set[object] = field(default_factory=set)  # requests waiting for its load, a pin to be taken for each
    promised: set[object] = field(default_factory=set)  # waiters a pin was taken for at the load, not claimed yet
    used: bool = True  # False from a load until a request gets it: evicting it then is thrash
    hits: int = 0
    last_used: float | None = None
    loads: int = 0
    disk_reads: int = 0
    disk_bytes: int = 0
    queued_at: float = 0.0
    read_seconds: float = 0.0
    layout_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def state(self) -> AdapterState:
        if self.error is not None:
            return "failed"
        if self.loading:
            return "loading"
        if self.device is not None:
            return "device"
        return "host" if self.host is not None else "registered"

    def info(self) -> AdapterInfo:
        spec = self.spec
        return AdapterInfo(
            id=spec.id,
            source=spec.source,
            kind="lora",
            rank=spec.max_rank,
            ranks=spec.module_ranks(),
            alpha=spec.config.lora_alpha,
            target_modules=spec.modules,
            rslora=spec.config.use_rslora,
            dora=spec.config.use_dora,
            saved_modules=spec.saved_modules,
            layers=spec.layers,
            state=self.state,
            host_bytes=self.host.nbytes if self.host is not None else 0,
            device_bytes=self.device_nbytes if self.device is not None else 0,
            hits=self.hits,
            last_used=self.last_used,
            registered_at=self.registered_at,
            pins=self.pins + len(self.promised),
            loads=self.loads,
            disk_reads=self.disk_reads,
            disk_bytes=self.disk_bytes,
            index_seconds=spec.index_seconds,
            read_seconds=self.read_seconds,
            layout_seconds=self.layout_seconds,
            total_seconds=self.total_seconds,
            error=str(self.error) if self.error is not None else None,
            evictions=self.evictions,
        )


class Tiers:
    """Residency and budgets of the device and host tiers (see the module docstring); caller holds the lock."""

    def __init__(
        self, entries: dict[str, Entry], device_budget: int, host_budget: int, overflow_limit: int = 0
    ) -> None:
        self.entries = entries
        self.device_budget = device_budget
        self.host_budget = host_budget
        self.overflow_limit = overflow_limit
        self.device: dict[str, tuple[LoraLayer | None, ...]] = {}  # read without the lock by layer()
        self.device_lru: OrderedDict[str, None] = OrderedDict()
        self.host_lru: OrderedDict[str, None] = OrderedDict()
        self.device_used = 0
        self.device_reserved = 0  # room held for the load in progress
        self.host_used = 0
        self.overflow: set[str] = set()  # adapters whose copy (or load in progress) is an overflow copy
        self.overflow_used = 0  # bytes of overflow copies (charged to the host budget)
        self.overflow_reserved = 0  # room held for an overflow load in progress (charged to the host budget)

    def touch(self, adapter_id: str, entry: Entry) -> None:
        entry.last_used = time.time()
        if entry.device is not None and not entry.overflow:
            self.device_lru[adapter_id] = None
            self.device_lru.move_to_end(adapter_id)
        if entry.host is not None:
            self.host_lru[adapter_id] = None
            self.host_lru.move_to_end(adapter_id)
        self.show(adapter_id, entry)  # a load ends with a touch, its copies in place

    @staticmethod
    def show(adapter_id: str, entry: Entry) -> None:
        """Bring the adapter's per-adapter residency gauge up to its copies now (by the change since last shown)."""
        now = (
            entry.device_nbytes if entry.device is not None else 0,
            entry.host.nbytes if entry.host is not None else 0,
        )
        if now != entry.shown:
            metrics.ADAPTERS.resident(adapter_id, "device", now[0] - entry.shown[0])
            metrics.ADAPTERS.resident(adapter_id, "host", now[1] - entry.shown[1])
            entry.shown = now

    def reserve(self, adapter_id: str, entry: Entry) -> bool:
        """Room for ``entry``'s load: on the device tier (evicting as needed), else as an overflow copy; False when
        neither has room (wait for an unpin). The room is held until ``end_load``."""
        for other in list(self.overflow):  # an overflow copy nothing holds goes first
            if (e := self.entries.get(other)) is not None:
                self.settle(other, e)
        if self.make_device_room(entry.device_nbytes, adapter_id):
            self.device_reserved += entry.device_nbytes
            return True
        if len(self.overflow) >= self.overflow_limit or not self.make_host_room(entry.device_nbytes, adapter_id):
            return False
        self.overflow.add(adapter_id)
        entry.overflow = True
        self.overflow_reserved += entry.device_nbytes
        metrics.ADAPTER_OVERFLOW_LOADS.inc()
        log.info("event=adapter_overflow adapter=%s bytes=%d overflow=%d", adapter_id, entry.device_nbytes,
                 len(self.overflow))  # fmt: skip
        return True

    def end_load(self, adapter_id: str, entry: Entry, layers: tuple[LoraLayer | None, ...] | None) -> None:
        """Release the room ``reserve`` held; with ``layers`` (the load succeeded), publish them in that room."""
        if entry.overflow:
            self.overflow_reserved -= entry.device_nbytes
        else:
            self.device_reserved -= entry.device_nbytes
        if layers is None:
            self.overflow.discard(adapter_id)
            entry.overflow = False
            return
        entry.device = layers
        self.device[adapter_id] = layers
        if entry.overflow:
            self.overflow_used += entry.device_nbytes
        else:
            self.device_used += entry.device_nbytes

    def settle(self, adapter_id: str, entry: Entry) -> None:
        """Drop ``entry``'s overflow copy if nothing holds it any more (the caller wakes a load waiting for room)."""
        if entry.overflow and entry.device is not None and not self.held(entry):
            self.drop_device(adapter_id, entry)
            log.info("event=adapter_overflow_dropped adapter=%s", adapter_id)

    def make_device_room(self, need: int, keep: str) -> bool:
        """Evict least recently used unpinned adapters until ``need`` more bytes fit; False (evicting nothing) if
        they cannot."""
        free = self.device_budget - self.device_used - self.device_reserved
        evictable = sum(e.device_nbytes for k in self.device_lru if k != keep and not self.held(e := self.entries[k]))
        if need > free + evictable:
            return False
        while self.device_used + self.device_reserved + need > self.device_budget:
            victim = next((k for k in self.device_lru if k != keep and not self.held(self.entries[k])), None)
            if victim is None:
                return False
            if not self.entries[victim].used:
                metrics.ADAPTER_EVICTIONS_UNUSED.labels(tier="device").inc()
                log.warning("event=adapter_evicted_unused tier=device adapter=%s", victim)
            self.entries[victim].evictions += 1
            self.drop_device(victim, self.entries[victim])
            metrics.ADAPTER_CACHE_EVENTS.labels(event="eviction", tier="device").inc()
            metrics.ADAPTERS.evicted(victim, "device")
            log.info("event=adapter_evicted tier=device adapter=%s", victim)
        return True

    @staticmethod
    def held(entry: Entry) -> bool:
        """Pinned by a running request, or for a waiting one that has not claimed it yet."""
        return entry.pins > 0 or bool(entry.promised)

    def make_host_room(self, need: int, keep: str) -> bool:
        if need > self.host_budget:
            return False
        while self.host_used + self.overflow_used + self.overflow_reserved + need > self.host_budget:
            victim = next((k for k in self.host_lru if k != keep), None)
            if victim is None:  # the rest is overflow copies (and ``keep``'s own host copy)
                return False
            self.drop_host(victim, self.entries[victim])
            metrics.ADAPTER_CACHE_EVENTS.labels(event="eviction", tier="host").inc()
            metrics.ADAPTERS.evicted(victim, "host")
            log.info("event=adapter_evicted tier=host adapter=%s", victim)
        return True

    def drop_device(self, adapter_id: str, entry: Entry) -> None:
        if entry.device is not None:
            self.device.pop(adapter_id, None)
            self.device_lru.pop(adapter_id, None)
            if entry.overflow:
                self.overflow.discard(adapter_id)
                self.overflow_used -= entry.device_nbytes
                entry.overflow = False
            else:
                self.device_used -= entry.device_nbytes
            entry.device = None
            self.show(adapter_id, entry)
            self.publish()

    def drop_host(self, adapter_id: str, entry: Entry) -> None:
        if entry.host is not None:
            self.host_lru.pop(adapter_id, None)
            self.host_used -= entry.host.nbytes
            entry.host = None
            self.show(adapter_id, entry)
            self.publish()

    def publish(self) -> None:
        metrics.ADAPTERS_REGISTERED.set(len(self.entries))
        metrics.ADAPTER_RESIDENT.labels(tier="device").set(len(self.device_lru))
        metrics.ADAPTER_RESIDENT.labels(tier="host").set(len(self.host_lru))
        metrics.ADAPTER_RESIDENT_BYTES.labels(tier="device").set(self.device_used)
        metrics.ADAPTER_RESIDENT_BYTES.labels(tier="host").set(self.host_used)
        metrics.ADAPTER_OVERFLOW_BYTES.set(self.overflow_used)


__all__ = ["Entry", "Tiers"]
