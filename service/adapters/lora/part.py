"""LoRA weights as an adapter part: the catalog's view of the ``AdapterStore`` (``PartKind``) and one request's
pin on a LoRA part (``PartClaim``).

A folder is a LoRA part when it holds ``adapter_config.json``. The claim owns its request's pin and its claim on a
load in flight; ``release`` gives both back. Loads run on the store's thread, never here.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from pathlib import Path

from service.adapters.common.part import Binding, PartUsage
from service.adapters.lora.peft import CONFIG_FILE
from service.adapters.lora.store import AdapterStore
from service.adapters.lora.types import LoraLayer
from service.errors import AdapterNotFound, LoraplexError

_DELTAS = Binding(deltas=True)


class LoraClaim:
    """One request's hold on a LoRA part (see the module docstring)."""

    __slots__ = ("_pinned", "_store", "id")

    def __init__(self, store: AdapterStore, adapter_id: str) -> None:
        self._store = store
        self.id = adapter_id
        self._pinned = False

    def load(self) -> None:
        if not self._pinned:
            self._pinned = self._store.request(self.id, pin=True, waiter=self)

    def release(self) -> None:
        if self._pinned:
            self._pinned = False
            self._store.unpin(self.id)
        else:
            self._store.forget(self.id, self)

    def ready(self) -> bool:
        return self._pinned

    @property
    def pinned(self) -> bool:
        return self._pinned

    def failure(self) -> LoraplexError | None:
        return self._store.failure(self.id)

    def kv_key(self) -> Hashable | None:
        """The registration: a re-registered id gets a new key (its deltas, and so its K/V, may differ)."""
        return (self.id, self._store.get(self.id).registered_at)

    def drafts(self) -> bool:
        return False

    def binding(self) -> Binding:
        return _DELTAS


class LoraPart:
    """The LoRA kind in the catalog's table; ``store`` keeps the parts' tiers, pins and loads."""

    markers: tuple[str, ...] = (CONFIG_FILE,)

    def __init__(self, store: AdapterStore) -> None:
        self.store = store

    def owns(self, folder: Path) -> bool:
        return (folder / CONFIG_FILE).is_file()

    def register(self, adapter_id: str, folder: Path) -> None:
        self.store.register(adapter_id, folder)

    def unregister(self, adapter_id: str) -> None:
        self.store.unregister(adapter_id)

    def has(self, adapter_id: str) -> bool:
        try:
            self.store.get(adapter_id)
        except AdapterNotFound:
            return False
        return True

    def ids(self) -> Iterable[str]:
        return [info.id for info in self.store.list()]

    def prefetch(self, adapter_id: str) -> None:
        self.store.prefetch(adapter_id)

    def claim(self, adapter_id: str) -> LoraClaim:
        return LoraClaim(self.store, adapter_id)

    def usage(self, adapter_id: str) -> PartUsage:
        info = self.store.get(adapter_id)
        return PartUsage(info.device_bytes, info.host_bytes, info.state == "device")

    def layer(self, adapter_id: str, layer: int) -> LoraLayer | None:
        return self.store.layer(adapter_id, layer)

    def close(self, timeout: float | None = None) -> None:
        self.store.close(timeout)


__all__ = ["LoraClaim", "LoraPart"]
