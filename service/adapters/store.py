"""The adapter store: registered adapters, a device tier and a host tier with byte budgets, and a loader thread.

Public API::

    AdapterStore(model_config, *, device, dtype, device_budget_bytes, host_budget_bytes, roots=(), max_open_files=64)
        .register(adapter_id, path) -> AdapterInfo        config + safetensors header only
        .unregister(adapter_id)                           FailedPrecondition while pinned
        .get(adapter_id) -> AdapterInfo / .list() -> list[AdapterInfo] / .state() -> StoreState
        .request(adapter_id, *, pin=False) -> bool        non-blocking; schedules a load when not resident
        .failure(adapter_id) -> LoraplexError | None
        .pin(adapter_id) / .unpin(adapter_id)
        .layer(adapter_id, layer) -> LoraLayer | None     engine thread, in the forward: O(1), no allocation
        .ensure(adapter_id, *, timeout=None)              blocking request (tests, CLI, warm-up; not the engine)
        .close()
    AdapterInfo, StoreState, AdapterState             (defined in service.adapters.types)

Tiers. The *device tier* holds ``LoraLayer`` objects on the serving device in the serving dtype, ``lora_B``
already scaled; the *host tier* holds the raw tensors as read from the file (pinned memory when serving on CUDA).
On a CPU server both live in CPU memory with the same meaning. Host copies are inclusive: loading from disk keeps
the raw copy (when the host budget allows), so evicting an adapter from the device tier leaves it in the host
tier and a later reuse lays it out again without touching the disk. When a tier would exceed its budget the
least recently used adapter leaves it: from the device tier only adapters with no pins; from the host tier any
host copy (the device copy, if any, stays). An adapter that is neither on the device nor in the host tier is
"registered" (disk only). The raw buffer of a disk read in progress is not counted until it joins the host tier.

Loading. ``request`` never blocks: it returns True when every layer of the adapter is resident on the device
tier, and otherwise queues one load on the loader thread and returns False (single flight: requests for an
adapter already queued or loading queue nothing). The loader makes room on the device tier first (waiting for
an unpin when every resident adapter is pinned), then for each touched layer reads that layer's tensors with one
``service.loading.load_tensors`` call into the host buffer (or reuses the host copy) and lays them out on the
device. The store keeps file *names*, never open handles; each per-layer read opens the adapter's one weights
file and closes it again, so the store holds at most one descriptor at a time (``max_open_files`` only bounds
that). A failed load marks the adapter failed: ``request`` then returns False, ``failure`` returns the error
(a ``LoraplexError``: the ``CheckpointError`` naming file and tensor, ``ResourceExhausted`` for an adapter larger
than the whole device budget), and it stays failed until unregistered and registered again.

Engine protocol. Call ``request(id, pin=True)`` each step for a waiting row: the first True pins the adapter in
the same critical section, so it cannot be evicted before the row runs; while it is False, ``failure(id)`` not
None means fail the row with that error; ``unpin`` when the row retires. ``pin``
also works on an adapter that is not resident (it then cannot be evicted once loaded). ``layer`` takes no lock
and is only valid for pinned adapters. ``unregister`` of a pinned adapter raises ``FailedPrecondition``
(finish or cancel the requests first); an unpinned adapter that is loading is dropped when the load ends. On
CUDA the engine is assumed to read adapter weights on the device's default stream: the loader copies on its own
stream, synchronises it before publishing, and marks each buffer as used by the default stream so that memory
freed by an eviction is not reused while the engine's queued kernels may still read it.

Thread safety: one lock guards all state; file reads and tensor work run outside it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from service import metrics
from service.adapters.registry import AdapterSpec, SlotRecords, buffer_views, index_adapter, plan_buffer, plan_nbytes
from service.adapters.types import AdapterInfo, AdapterState, LoraLayer, LoraModule, StoreState
from service.errors import (
    AdapterNotFound,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidAdapter,
    LoraplexError,
    ResourceExhausted,
    Unavailable,
)
from service.loading import load_tensors
from service.model.config import ModelConfig

log = logging.getLogger(__name__)

HOST_ALIGN = 64  # bytes; every tensor view in a host or device buffer starts on this boundary
DEVICE_ALIGN = 256
_LayerList = list[LoraLayer | None]  # (the class below has a method named list)


@dataclass(eq=False)
class _HostCopy:
    buffer: torch.Tensor  # [nbytes] uint8, pinned on CUDA servers
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # raw A [r, in], B [out, r] (file dtype)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())


@dataclass(eq=False)
class _Entry:
    spec: AdapterSpec
    registered_at: float
    host_nbytes: int  # size of the host-tier buffer (raw tensors, 64-byte aligned)
    device_nbytes: int  # size of the device-tier buffer (laid out, serving dtype, 256-byte aligned)
    host: _HostCopy | None = None
    device: tuple[LoraLayer | None, ...] | None = None  # indexed by layer
    loading: bool = False
    error: LoraplexError | None = None
    pins: int = 0
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


@dataclass
class _Loaded:
    layers: tuple[LoraLayer | None, ...]
    host: _HostCopy
    from_disk: bool
    bytes_read: int
    read_seconds: float
    layout_seconds: float


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
        max_open_files: int = 64,
    ) -> None:
        if device_budget_bytes < 0 or host_budget_bytes < 0:
            raise ValueError("adapter budgets must be >= 0 bytes")
        if max_open_files < 1:
            raise ValueError("max_open_files must be >= 1")
        self.model_config = model_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.device_budget_bytes = device_budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self.roots = tuple(Path(r) for r in roots)
        self.max_open_files = max_open_files
        self._pin_host = self.device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None  # created by the loader thread on first use
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._entries: dict[str, _Entry] = {}
        self._device: dict[str, tuple[LoraLayer | None, ...]] = {}  # read without the lock by layer()
        self._device_lru: OrderedDict[str, None] = OrderedDict()
        self._host_lru: OrderedDict[str, None] = OrderedDict()
        self._device_used = 0
        self._device_reserved = 0  # room held for the load in progress
        self._host_used = 0
        self._disk_reads = 0
        self._disk_bytes = 0
        self._queue: deque[str] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False
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
        metrics.ADAPTER_LOAD_DURATION.labels(stage="index", tier="disk").observe(spec.index_seconds)
        entry = _Entry(
            spec=spec,
            registered_at=time.time(),
            host_nbytes=plan_nbytes(spec, None, HOST_ALIGN),
            device_nbytes=plan_nbytes(spec, self.dtype, DEVICE_ALIGN),
        )
        with self._lock:
            if adapter_id in self._entries:
                raise AlreadyExists(f"adapter {adapter_id!r} is already registered (unload it first)")
            self._entries[adapter_id] = entry
            self._publish()
            return self._info(entry)

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
            self._drop_device(adapter_id, entry)
            self._drop_host(adapter_id, entry)
            if adapter_id in self._queue:
                self._queue.remove(adapter_id)
            self._publish()
            self._cond.notify_all()

    def get(self, adapter_id: str) -> AdapterInfo:
        with self._lock:
            return self._info(self._entry(adapter_id))

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(e) for _, e in sorted(self._entries.items())]

    def state(self) -> StoreState:
        with self._lock:
            return StoreState(
                adapters={k: self._info(e) for k, e in sorted(self._entries.items())},
                device_bytes=self._device_used,
                host_bytes=self._host_used,
                device_budget_bytes=self.device_budget_bytes,
                host_budget_bytes=self.host_budget_bytes,
                device_lru=tuple(self._device_lru),
                host_lru=tuple(self._host_lru),
                queued=tuple(self._queue),
                disk_reads=self._disk_reads,
                disk_bytes=self._disk_bytes,
            )

    # --- serving ----------------------------------------------------------------------------------------------

    def request(self, adapter_id: str, *, pin: bool = False) -> bool:
        """True if every layer is resident on the device tier (and, with ``pin``, pin it); else queue a load
        (unless one is queued or running) and return False.

        False also for an adapter that cannot load: ``failure(adapter_id)`` then returns why (the load's error,
        or ``ResourceExhausted`` for an adapter larger than the whole device budget, decided here, before any
        read). Raises only ``AdapterNotFound`` (never registered, or unregistered meanwhile) and ``Unavailable``
        after ``close``."""
        with self._cond:
            entry = self._entry(adapter_id)
            if entry.error is not None:
                return False
            if entry.device is not None:
                entry.hits += 1
                entry.pins += 1 if pin else 0
                self._touch(adapter_id, entry)
                metrics.ADAPTER_CACHE_EVENTS.labels(event="hit", tier="device").inc()
                return True
            if entry.device_nbytes > self.device_budget_bytes:
                entry.error = ResourceExhausted(
                    f"adapter {adapter_id!r} needs {entry.device_nbytes} bytes on the device, more than the "
                    f"whole adapter device budget of {self.device_budget_bytes} bytes (--adapter-device-budget)"
                )
                self._cond.notify_all()
                return False
            self._queue_load(adapter_id, entry)
            return False

    def prefetch(self, adapter_id: str) -> None:
        """Start loading a registered adapter that is neither resident nor loading, without a hit, a miss or a
        pin: the engine calls it the moment a request arrives, so the read overlaps the decode step in flight.
        Quiet for unknown ids, failed or oversized adapters and a closed store (``request`` reports those)."""
        with self._cond:
            entry = self._entries.get(adapter_id)
            if entry is None or entry.error is not None or entry.device is not None or self._closed:
                return
            # Only into free room: evicting for a request that may wait in the queue a while could evict what
            # the running batch needs next; under pressure, admission (``request``) decides.
            if self._device_used + self._device_reserved + entry.device_nbytes <= self.device_budget_bytes:
                self._queue_load(adapter_id, entry)

    def _queue_load(self, adapter_id: str, entry: _Entry) -> None:
        """Under the lock: queue ``entry``'s load unless one is queued or running."""
        if self._closed:
            raise Unavailable("the adapter store is closed")
        if not entry.loading:
            entry.loading = True
            entry.queued_at = time.perf_counter()
            self._queue.append(adapter_id)
            metrics.ADAPTER_CACHE_EVENTS.labels(event="miss", tier="device").inc()
            self._start_loader()
            self._cond.notify_all()

    def failure(self, adapter_id: str) -> LoraplexError | None:
        """The error that made this adapter's load fail, or None. ``AdapterNotFound`` if not registered."""
        with self._lock:
            return self._entry(adapter_id).error

    def pin(self, adapter_id: str) -> None:
        """Hold the adapter on the device tier (refcount): a pinned adapter is never evicted or unregistered."""
        with self._lock:
            entry = self._entry(adapter_id)
            entry.pins += 1
            self._touch(adapter_id, entry)

    def unpin(self, adapter_id: str) -> None:
        with self._cond:
            entry = self._entry(adapter_id)
            if entry.pins == 0:
                raise FailedPrecondition(f"adapter {adapter_id!r} is not pinned")
            entry.pins -= 1
            self._touch(adapter_id, entry)
            if entry.pins == 0:
                self._cond.notify_all()  # a load waiting for room may proceed

    def layer(self, adapter_id: str, layer: int) -> LoraLayer | None:
        """The device-tier weights of one layer (None: the adapter does not touch it). No lock, no allocation:
        valid only while the adapter is pinned."""
        try:
            return self._device[adapter_id][layer]
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
                    raise entry.error
                if entry is not None and entry.loading:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise DeadlineExceeded(f"adapter {adapter_id!r} did not load within {timeout} s")
                    self._cond.wait(left)

    def close(self) -> None:
        """Stop the loader thread (a load in progress finishes first). Registered adapters stay readable."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def __enter__(self) -> AdapterStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the loader thread -----------------------------------------------------------------------------------

    def _start_loader(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loader, name="loraplex-adapter-loader", daemon=True)
            self._thread.start()

    def _loader(self) -> None:
        while True:
            with self._cond:
                job = self._next_job()
                if job is None:
                    return
                adapter_id, entry = job
                host = entry.host
            try:
                loaded = self._load(entry.spec, entry, host)
            except Exception as e:  # the loader must survive anything; the rows waiting get the error
                error = e if isinstance(e, LoraplexError) else _wrap(e, entry.spec)
                if not isinstance(e, LoraplexError):
                    log.exception("event=adapter_load_error adapter=%s", adapter_id)
                with self._cond:
                    self._device_reserved -= entry.device_nbytes
                    entry.loading = False
                    entry.error = error
                    self._cond.notify_all()
                log.warning("event=adapter_load_failed adapter=%s error=%s", adapter_id, error)
                continue
            with self._cond:
                self._commit(adapter_id, entry, loaded)
                self._cond.notify_all()

    def _next_job(self) -> tuple[str, _Entry] | None:
        """Under the lock: the next adapter to load with device room reserved for it (waits as needed)."""
        while True:
            if self._closed:
                return None
            if not self._queue:
                self._cond.wait()
                continue
            adapter_id = self._queue[0]
            entry = self._entries.get(adapter_id)
            if entry is None or not entry.loading:
                self._queue.popleft()
                continue
            if not self._make_device_room(entry.device_nbytes, adapter_id):
                self._cond.wait()  # every resident adapter is pinned: wait for an unpin or unregister
                continue
            self._queue.popleft()
            self._device_reserved += entry.device_nbytes
            return adapter_id, entry

    def _load(self, spec: AdapterSpec, entry: _Entry, host: _HostCopy | None) -> _Loaded:
        """Outside the lock: read (unless a host copy exists) and lay out every touched layer."""
        from_disk = host is None
        if host is None:
            host_plan = plan_buffer(spec, None, HOST_ALIGN)
            buffer = torch.empty(host_plan.nbytes, dtype=torch.uint8, pin_memory=self._pin_host)
            host = _HostCopy(buffer, buffer_views(spec, host_plan, buffer, None))
        device_plan = plan_buffer(spec, self.dtype, DEVICE_ALIGN)
        if self.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream = self._stream  # the loader's own copy stream: layout never waits behind the engine's kernels
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            device_buffer = torch.empty(device_plan.nbytes, dtype=torch.uint8, device=self.device)
        if stream is not None:
            # Written on the loader's stream, read by the engine on the default stream: when an eviction frees
            # it, the allocator must wait for the engine's queued kernels before handing the memory out again.
            device_buffer.record_stream(torch.cuda.default_stream(self.device))
        device_views = buffer_views(spec, device_plan, device_buffer, self.dtype)
        layers: _LayerList = [None] * spec.num_layers
        read_s = layout_s = 0.0
        nbytes = 0
        for layer in spec.layers:
            slots = spec.layer_records(layer)
            if from_disk:
                t0 = time.perf_counter()
                plan = {}
                for s in slots:
                    a, b = host.tensors[(layer, s.module)]
                    plan[s.a.name], plan[s.b.name] = a, b
                records = {r.name: r for s in slots for r in (s.a, s.b)}
                stats = load_tensors(records, plan, mode="stream", threads=1)
                nbytes += stats.bytes_read
                read_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            layers[layer] = self._lay_out(layer, slots, host, device_views, stream)
            layout_s += time.perf_counter() - t0
        if stream is not None:
            t0 = time.perf_counter()
            stream.synchronize()
            layout_s += time.perf_counter() - t0
        return _Loaded(tuple(layers), host, from_disk, nbytes, read_s, layout_s)

    def _lay_out(
        self,
        layer: int,
        slots: Sequence[SlotRecords],
        host: _HostCopy,
        device_views: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        stream: torch.cuda.Stream | None,
    ) -> LoraLayer:
        modules: dict[str, LoraModule] = {}
        nbytes = 0
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for s in slots:
                a_raw, b_raw = host.tensors[(layer, s.module)]  # [r, in], [out, r] in the file's dtype
                a, b = device_views[(layer, s.module)]  # same shapes, serving dtype, on the device
                a.copy_(a_raw, non_blocking=True)
                if b.dtype == torch.float32:
                    b.copy_(b_raw, non_blocking=True).mul_(s.scaling)
                else:  # scale in fp32, round once
                    b.copy_(b_raw.to(self.device, non_blocking=True).float().mul_(s.scaling))
                modules[s.module] = LoraModule(a=a, b=b)
                nbytes += a.nbytes + b.nbytes
        return LoraLayer(modules=modules, nbytes=nbytes)

    def _commit(self, adapter_id: str, entry: _Entry, loaded: _Loaded) -> None:
        """Under the lock: publish a finished load (or drop it if the adapter was unregistered meanwhile)."""
        self._device_reserved -= entry.device_nbytes
        entry.loading = False
        if self._entries.get(adapter_id) is not entry:
            return
        total = time.perf_counter() - entry.queued_at
        entry.device = loaded.layers
        self._device[adapter_id] = loaded.layers
        self._device_used += entry.device_nbytes
        entry.loads += 1
        entry.read_seconds, entry.layout_seconds, entry.total_seconds = (
            loaded.read_seconds,
            loaded.layout_seconds,
            total,
        )
        tier = "disk" if loaded.from_disk else "host"
        if loaded.from_disk:
            entry.disk_reads += 1
            entry.disk_bytes += loaded.bytes_read
            self._disk_reads += 1
            self._disk_bytes += loaded.bytes_read
            metrics.ADAPTER_READ_BYTES.inc(loaded.bytes_read)
            metrics.ADAPTER_CACHE_EVENTS.labels(event="miss", tier="host").inc()
            metrics.ADAPTER_LOAD_DURATION.labels(stage="read", tier=tier).observe(loaded.read_seconds)
            if self._make_host_room(loaded.host.nbytes, adapter_id):
                entry.host = loaded.host
                self._host_used += loaded.host.nbytes
        else:
            metrics.ADAPTER_CACHE_EVENTS.labels(event="hit", tier="host").inc()
        metrics.ADAPTER_LOAD_DURATION.labels(stage="layout", tier=tier).observe(loaded.layout_seconds)
        metrics.ADAPTER_LOAD_DURATION.labels(stage="total", tier=tier).observe(total)
        metrics.ADAPTERS.loaded(adapter_id, total)
        self._touch(adapter_id, entry)
        self._publish()
        log.info(
            "event=adapter_loaded adapter=%s from=%s read_s=%.4f layout_s=%.4f total_s=%.4f bytes=%d",
            adapter_id,
            tier,
            loaded.read_seconds,
            loaded.layout_seconds,
            total,
            entry.device_nbytes,
        )

    # --- tiers (all under the lock) --------------------------------------------------------------------------

    def _entry(self, adapter_id: str) -> _Entry:
        entry = self._entries.get(adapter_id)
        if entry is None:
            raise AdapterNotFound(adapter_id)
        return entry

    def _touch(self, adapter_id: str, entry: _Entry) -> None:
        entry.last_used = time.time()
        if entry.device is not None:
            self._device_lru[adapter_id] = None
            self._device_lru.move_to_end(adapter_id)
        if entry.host is not None:
            self._host_lru[adapter_id] = None
            self._host_lru.move_to_end(adapter_id)

    def _make_device_room(self, need: int, keep: str) -> bool:
        """Evict least recently used unpinned adapters until ``need`` more bytes fit; False if they cannot."""
        while self._device_used + self._device_reserved + need > self.device_budget_bytes:
            victim = next((k for k in self._device_lru if k != keep and not self._entries[k].pins), None)
            if victim is None:
                return False
            self._drop_device(victim, self._entries[victim])
            metrics.ADAPTER_CACHE_EVENTS.labels(event="eviction", tier="device").inc()
            metrics.ADAPTERS.evicted(victim, "device")
            log.info("event=adapter_evicted tier=device adapter=%s", victim)
        return True

    def _make_host_room(self, need: int, keep: str) -> bool:
        if need > self.host_budget_bytes:
            return False
        while self._host_used + need > self.host_budget_bytes:
            victim = next(k for k in self._host_lru if k != keep)
            self._drop_host(victim, self._entries[victim])
            metrics.ADAPTER_CACHE_EVENTS.labels(event="eviction", tier="host").inc()
            metrics.ADAPTERS.evicted(victim, "host")
            log.info("event=adapter_evicted tier=host adapter=%s", victim)
        return True

    def _drop_device(self, adapter_id: str, entry: _Entry) -> None:
        if entry.device is not None:
            self._device.pop(adapter_id, None)
            self._device_lru.pop(adapter_id, None)
            self._device_used -= entry.device_nbytes
            entry.device = None
            self._publish()

    def _drop_host(self, adapter_id: str, entry: _Entry) -> None:
        if entry.host is not None:
            self._host_lru.pop(adapter_id, None)
            self._host_used -= entry.host.nbytes
            entry.host = None
            self._publish()

    def _publish(self) -> None:
        metrics.ADAPTERS_REGISTERED.set(len(self._entries))
        metrics.ADAPTER_RESIDENT.labels(tier="device").set(len(self._device_lru))
        metrics.ADAPTER_RESIDENT.labels(tier="host").set(len(self._host_lru))
        metrics.ADAPTER_RESIDENT_BYTES.labels(tier="device").set(self._device_used)
        metrics.ADAPTER_RESIDENT_BYTES.labels(tier="host").set(self._host_used)

    def _info(self, e: _Entry) -> AdapterInfo:
        spec = e.spec
        return AdapterInfo(
            id=spec.id,
            source=spec.source,
            kind="lora",
            rank=spec.max_rank,
            ranks=spec.module_ranks(),
            alpha=spec.config.lora_alpha,
            target_modules=spec.modules,
            rslora=spec.config.use_rslora,
            layers=spec.layers,
            state=e.state,
            host_bytes=e.host.nbytes if e.host is not None else 0,
            device_bytes=e.device_nbytes if e.device is not None else 0,
            hits=e.hits,
            last_used=e.last_used,
            registered_at=e.registered_at,
            pins=e.pins,
            loads=e.loads,
            disk_reads=e.disk_reads,
            disk_bytes=e.disk_bytes,
            index_seconds=spec.index_seconds,
            read_seconds=e.read_seconds,
            layout_seconds=e.layout_seconds,
            total_seconds=e.total_seconds,
            error=str(e.error) if e.error is not None else None,
        )


def _wrap(error: Exception, spec: AdapterSpec) -> LoraplexError:
    if isinstance(error, OSError):
        return InvalidAdapter(f"cannot read the adapter weights: {error}", file=spec.file)
    return LoraplexError(f"loading adapter {spec.id!r} failed: {type(error).__name__}: {error}")


__all__ = ["AdapterInfo", "AdapterState", "AdapterStore", "StoreState"]
