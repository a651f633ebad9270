"""Registered Medusa heads: indexed at registration (config + headers), loaded onto the device on first use.

Every read goes through ``integrity.open_verified`` (the files as indexed, inside the path policy) and the loaded
tensors are checked finite; a file changed since registration is indexed again before it is loaded. A failed
load stays failed until one of its files changes; the next ``request`` after that loads it again.
Loads run on one worker thread (single flight: concurrent requests for the same cold heads queue one load), so
the engine never reads a file. Heads are a few MB per adapter (SmolLM2: one 576x576 block per head), so they stay
on the device until unregistered; the LoRA part of a Medusa + LoRA adapter lives in the ``AdapterStore`` and its
tiers like any LoRA.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from service import metrics
from service.adapters.common.files import AdapterFileChanged, FileStamp, open_verified, stamp
from service.adapters.medusa.format import MedusaSpec, index_medusa
from service.adapters.medusa.heads import MedusaHeads
from service.errors import AdapterNotFound, AlreadyExists, LoraplexError, Unavailable
from service.model.config import ModelConfig
from service.torch_threads import serial_torch

__all__ = ["RETRY_CHECK_SECONDS", "MedusaRegistry"]

RETRY_CHECK_SECONDS = 1.0  # a failed adapter's files are stat()ed at most this often, to retry once they changed


@dataclass(eq=False)
class _Entry:
    spec: MedusaSpec
    heads: MedusaHeads | None = None
    loading: Future[MedusaHeads] | None = None
    error: LoraplexError | None = None
    load_seconds: float = 0.0
    hits: int = field(default=0)
    failed_stamps: tuple[FileStamp | None, ...] = ()  # the files when the load failed: retried once they differ
    checked_at: float = 0.0


class MedusaRegistry:
    def __init__(
        self,
        model_config: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        check_path: Callable[[Path], object] | None = None,
    ) -> None:
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self._check_path = check_path
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="loraplex-medusa-loader", initializer=serial_torch
        )
        self._closed = False

    def register(self, adapter_id: str, folder: Path) -> MedusaSpec:
        with self._lock:
            if adapter_id in self._entries:
                raise AlreadyExists(f"adapter {adapter_id!r} is already registered (unload it first)")
        spec = index_medusa(folder, self.model_config, check_path=self._check_path)
        metrics.ADAPTER_LOAD_DURATION.labels(stage="index", tier="disk").observe(spec.index_seconds)
        with self._lock:
            if adapter_id in self._entries:
                raise AlreadyExists(f"adapter {adapter_id!r} is already registered (unload it first)")
            self._entries[adapter_id] = _Entry(spec)
        return spec

    def unregister(self, adapter_id: str) -> None:
        with self._lock:
            if self._entries.pop(adapter_id, None) is None:
                raise AdapterNotFound(adapter_id)

    def has(self, adapter_id: str) -> bool:
        return adapter_id in self._entries

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def spec(self, adapter_id: str) -> MedusaSpec:
        return self._entry(adapter_id).spec

    def loaded(self, adapter_id: str) -> bool:
        entry = self._entries.get(adapter_id)
        return entry is not None and entry.heads is not None

    def request(self, adapter_id: str) -> bool:
        """True when the heads are on the device; otherwise queue their load (once) and return False."""
        with self._lock:
            entry = self._entry(adapter_id)
            if entry.heads is not None:
                entry.hits += 1
                return True
            if entry.error is not None:
                if not self._changed_since_failure(entry):
                    return False
                entry.error = None  # its files changed: try again
            if self._closed:
                raise Unavailable("the Medusa registry is closed")
            if entry.loading is None:
                entry.loading = self._pool.submit(self._load, adapter_id, entry)
            return False

    @staticmethod
    def _changed_since_failure(entry: _Entry) -> bool:
        """Under the lock: whether a failed adapter's files differ from their indexed stamps (looked at no more
        often than ``RETRY_CHECK_SECONDS``); a changed file is indexed again by the next load."""
        now = time.monotonic()
        if now - entry.checked_at < RETRY_CHECK_SECONDS:
            return False
        entry.checked_at = now
        current = []
        for file in entry.spec.files:
            try:
                current.append(stamp(file))
            except OSError:
                return False  # still missing: stay failed
        return tuple(current) != entry.failed_stamps

    def failure(self, adapter_id: str) -> LoraplexError | None:
        return self._entry(adapter_id).error

    def heads(self, adapter_id: str) -> MedusaHeads:
        heads = self._entry(adapter_id).heads
        if heads is None:
            raise Unavailable(f"the Medusa heads of {adapter_id!r} are not loaded yet")
        return heads

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _entry(self, adapter_id: str) -> _Entry:
        entry = self._entries.get(adapter_id)
        if entry is None:
            raise AdapterNotFound(adapter_id)
        return entry

    def _read(self, spec: MedusaSpec) -> MedusaHeads:
        """Load the heads through descriptors checked against the spec's stamps and the path policy."""
        stamps = dict(zip(spec.files, spec.stamps, strict=True))

        def opener(file: Path) -> int:
            return open_verified(file, stamps.get(file), (), check_path=self._check_path)

        return MedusaHeads.load(spec, device=self.device, dtype=self.dtype, opener=opener)

    def _load(self, adapter_id: str, entry: _Entry) -> MedusaHeads:
        start = time.perf_counter()
        try:
            try:
                heads = self._read(entry.spec)
            except AdapterFileChanged:  # changed since registration: index it again, as a new registration would
                entry.spec = index_medusa(entry.spec.source, self.model_config, check_path=self._check_path)
                heads = self._read(entry.spec)
        except LoraplexError as exc:
            with self._lock:
                entry.error, entry.loading = exc, None
                entry.failed_stamps, entry.checked_at = _stamps(entry.spec), time.monotonic()
            raise
        except Exception as exc:  # an unreadable file mid-load: report it as the adapter's failure
            with self._lock:
                entry.error = Unavailable(f"loading the Medusa heads of {adapter_id!r} failed: {exc}")
                entry.loading = None
                entry.failed_stamps, entry.checked_at = _stamps(entry.spec), time.monotonic()
            raise
        entry.load_seconds = time.perf_counter() - start
        metrics.ADAPTER_LOAD_DURATION.labels(stage="total", tier="disk").observe(entry.load_seconds)
        metrics.ADAPTERS.loaded(adapter_id, entry.load_seconds)
        with self._lock:
            entry.heads, entry.loading = heads, None
        return heads


def _stamps(spec: MedusaSpec) -> tuple[FileStamp | None, ...]:
    out: list[FileStamp | None] = []
    for file in spec.files:
        try:
            out.append(stamp(file))
        except OSError:
            out.append(None)
    return tuple(out)
