"""An adapter resolved for one request: one claim per part it has (LoRA weights, Medusa heads, ...), behind one
object.

A request resolves its adapter id once (``AdapterCatalog.resolve``); below that point nothing asks what kind of
adapter it is: the engine reads the merged ``binding`` (per-layer deltas in the forward, a drafter) and the K/V key.
The object is per request: its claims own that request's pins and its claims on loads in flight, and ``release``
gives them back.

Commands (``load``, ``release``) change the parts' state; queries (``ready``, ``failure``,
``kv_key``, ``binding``) never do. Loads run on each kind's own threads, never here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from service.adapters.common.part import Binding, PartClaim
from service.errors import LoraplexError

_NOTHING = Binding()


class Adapter:
    """One request's view of a registered adapter (see the module docstring)."""

    __slots__ = ("_claims", "id")

    def __init__(self, adapter_id: str, claims: Sequence[PartClaim]) -> None:
        self.id = adapter_id
        self._claims = tuple(claims)

    # --- commands ---------------------------------------------------------------------------------------------
    def load(self) -> None:
        """Ask for every part that is not on the device yet (non-blocking). A part's pin is taken for this request
        the moment it is resident, so nothing can evict it before the request runs. Raises ``LoraplexError`` when
        the adapter was unregistered meanwhile or a kind is closed."""
        for claim in self._claims:
            claim.load()

    def release(self) -> None:
        """The request is done with the adapter: drop its pins, or its claims on loads it waited for."""
        for claim in self._claims:
            claim.release()

    # --- queries ----------------------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Every part is on the device (pinned for this request where its kind pins)."""
        return all(claim.ready() for claim in self._claims)

    def failure(self) -> LoraplexError | None:
        """Why a part cannot load (the first part's error), or None."""
        for claim in self._claims:
            error = claim.failure()
            if error is not None:
                return error
        return None

    def kv_key(self) -> Hashable | None:
        """What besides the tokens shapes a row's K/V (the first part's key that has one: the LoRA registration);
        None when no part changes the K/V."""
        for claim in self._claims:
            key = claim.kv_key()
            if key is not None:
                return key
        return None

    def binding(self) -> Binding:
        """What the ready parts give the request's rows, merged (call after ``ready``)."""
        out = _NOTHING
        for claim in self._claims:
            out = out.merge(claim.binding())
        return out

    def drafts(self) -> bool:
        """Whether a part brings a drafter once ready (known from registration: no load needed)."""
        return any(claim.drafts() for claim in self._claims)

    def __repr__(self) -> str:
        parts = ", ".join(type(c).__name__ for c in self._claims)
        return f"Adapter({self.id!r}, parts=[{parts}], ready={self.ready()})"


__all__ = ["Adapter"]
