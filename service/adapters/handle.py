"""An adapter resolved for one request: an optional LoRA part and optional Medusa heads, behind one object.

A request resolves its adapter id once (``AdapterCatalog.resolve``); below that point nothing branches on what
kind of adapter it is, only on the object's capabilities (``has_lora``, ``has_heads``). The object is per request:
it owns that request's pin on the LoRA part and its claim on a load in flight, and ``release`` gives both back.

Commands (``load``, ``pin``, ``unpin``, ``release``) change store state; queries (``ready``, ``failure``,
``kv_key``, ``heads``) never do. Loads run on the store's and the Medusa registry's own threads, never here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.errors import LoraplexError

if TYPE_CHECKING:
    from service.adapters.store import AdapterStore
    from service.medusa.heads import MedusaHeads
    from service.medusa.registry import MedusaRegistry


class Adapter:
    """One request's view of a registered adapter (see the module docstring)."""

    __slots__ = ("_heads", "_medusa", "_pinned", "_store", "has_heads", "has_lora", "id")

    def __init__(self, adapter_id: str, store: AdapterStore | None, medusa: MedusaRegistry | None) -> None:
        self.id = adapter_id
        self._store = store
        self._medusa = medusa
        self.has_lora = store is not None
        self.has_heads = medusa is not None
        self._pinned = False
        self._heads: bool = False

    # --- commands ---------------------------------------------------------------------------------------------
    def load(self) -> None:
        """Ask for every part that is not on the device yet (non-blocking). The LoRA part's pin is taken for this
        request the moment it is resident, so nothing can evict it before the request runs. Raises
        ``LoraplexError`` when the adapter was unregistered meanwhile or the store is closed."""
        if self._store is not None and not self._pinned:
            self._pinned = self._store.request(self.id, pin=True, waiter=self)
        if self._medusa is not None and not self._heads:
            self._heads = self._medusa.request(self.id)

    def pin(self) -> None:
        if self._store is not None and not self._pinned:
            self._store.pin(self.id)
            self._pinned = True

    def unpin(self) -> None:
        if self._store is not None and self._pinned:
            self._pinned = False
            self._store.unpin(self.id)

    def release(self) -> None:
        """The request is done with the adapter: drop its pin, or its claim on a load it waited for."""
        if self._store is None:
            return
        if self._pinned:
            self.unpin()
        else:
            self._store.forget(self.id, self)

    # --- queries ----------------------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Every part is on the device (the LoRA part pinned for this request)."""
        return (self._store is None or self._pinned) and (self._medusa is None or self._heads)

    @property
    def pinned(self) -> bool:
        return self._pinned

    def failure(self) -> LoraplexError | None:
        """Why a part cannot load (the store's or the registry's error), or None."""
        error = self._store.failure(self.id) if self._store is not None else None
        if error is None and self._medusa is not None:
            error = self._medusa.failure(self.id)
        return error

    def kv_key(self) -> tuple[str, float] | None:
        """What besides the tokens shapes a row's K/V: the LoRA registration (a re-registered id gets a new key,
        its deltas, and so its K/V, may differ). None without a LoRA part."""
        if self._store is None:
            return None
        return (self.id, self._store.get(self.id).registered_at)

    def heads(self) -> MedusaHeads | None:
        """The loaded Medusa heads, or None without heads (call after ``ready``)."""
        return self._medusa.heads(self.id) if self._medusa is not None else None

    def __repr__(self) -> str:
        return f"Adapter({self.id!r}, lora={self.has_lora}, heads={self.has_heads}, pinned={self._pinned})"


__all__ = ["Adapter"]
