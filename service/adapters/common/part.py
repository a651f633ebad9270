"""What an adapter *has*: parts, each of one kind (LoRA weights, Medusa heads, ...), behind two small protocols.

A ``PartKind`` is one kind's registry of parts: it recognises a folder as its own (``owns``), indexes it at
registration, loads parts on its own threads, and reports each part's bytes per tier (``usage``). A ``PartClaim``
is one request's hold on one part, with one lifecycle for every kind: ``load`` (non-blocking; the part is pinned
for the request once resident, where the kind pins) and ``release``; ``ready`` / ``failure``; the K/V key; and,
once ready, the ``Binding`` the engine reads (per-layer deltas in the forward, a drafter). The catalog
(``service.adapters.catalog``) holds the kinds (``service.adapters.kinds``); nothing below it asks which kind a
part is.

Each kind also records its own metrics (load latency by stage and tier, loads per adapter) under the shared names
of ``service.metrics``. This module imports no adapter kind and no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from service.drafters.base import Drafter
    from service.errors import LoraplexError


@dataclass(frozen=True, slots=True)
class Binding:
    """What a ready part gives the rows of its request; the parts of one adapter are merged into one."""

    deltas: bool = False  # the forward adds this adapter's per-layer deltas (looked up by adapter id)
    drafter: Drafter | None = None  # proposes draft tokens for the request's greedy rows

    def merge(self, other: Binding) -> Binding:
        return Binding(self.deltas or other.deltas, self.drafter if self.drafter is not None else other.drafter)


@dataclass(frozen=True, slots=True)
class PartUsage:
    """One part's residence: bytes per tier (device, host copy) and whether it is on the device now."""

    device_bytes: int
    host_bytes: int
    resident: bool


class PartClaim(Protocol):
    """One request's hold on one part: commands change the kind's state, queries never do."""

    def load(self) -> None:
        """Ask for the part (non-blocking); the part's pin is taken for the request once it is resident. Raises
        ``LoraplexError`` when it was unregistered meanwhile or its kind is closed."""

    def release(self) -> None:
        """The request is done with the part: drop its pin, or its claim on a load it waited for."""

    def ready(self) -> bool:
        """On the device (and pinned for this request where the kind pins)."""

    def failure(self) -> LoraplexError | None:
        """Why the part cannot load, or None."""

    def kv_key(self) -> Hashable | None:
        """What the part adds to the row's K/V identity besides the tokens (the prefix cache's key); None: nothing."""

    def drafts(self) -> bool:
        """Whether the part brings a drafter once ready (asked before it is loaded: request validation)."""

    def binding(self) -> Binding:
        """What the ready part gives its rows (call after ``ready``)."""


class PartKind(Protocol):
    """One kind's registry of parts, as the catalog sees it."""

    markers: tuple[str, ...]  # the files ``owns`` reads: the catalog checks them against the roots first

    def owns(self, folder: Path) -> bool:
        """Whether ``folder`` holds a part of this kind (reads only its ``markers``)."""

    def register(self, adapter_id: str, folder: Path) -> None:
        """Index the part in ``folder`` (config + headers); a problem is a ``LoraplexError`` naming the file."""

    def unregister(self, adapter_id: str) -> None:
        """Remove the part; ``FailedPrecondition`` (nothing removed) where the kind refuses while it is in use."""

    def has(self, adapter_id: str) -> bool: ...

    def ids(self) -> Iterable[str]: ...

    def prefetch(self, adapter_id: str) -> None:
        """Start loading the part if it is not on the device (non-blocking)."""

    def claim(self, adapter_id: str) -> PartClaim:
        """A new per-request hold on the part (nothing is loaded or pinned yet)."""

    def usage(self, adapter_id: str) -> PartUsage: ...

    def layer(self, adapter_id: str, layer: int) -> object | None:
        """The part's deltas for one layer of the forward (the batched math's per-layer type), or None. Engine
        thread, hot path: valid while a request holds the part ready."""

    def close(self, timeout: float | None = None) -> None:
        """Stop the kind's loaders (waiting up to ``timeout`` seconds for a load in progress where it can)."""


__all__ = ["Binding", "PartClaim", "PartKind", "PartUsage"]
