"""An adapter resolved for one request: one claim per part it has (LoRA weights, Medusa heads, ...), behind one
object.

A request resolves its adapter id once (``AdapterCatalog.resolve``); below that point nothing asks what kind of
adapter it is: the engine reads the merged ``binding`` (per-layer deltas in the forward, a drafter) and the K/V key.
The object is per request: its claims own that request's pins and its claims on loads in flight, and ``release``
gives them back.

Commands (``load``, ``release``) change the parts' state; queries (``ready``, ``failure``,
``kv_key``, ``binding``) never do. Loads run on each kind's own threads, never here.

A ``Mixture`` is one request's view of several adapters at weights (or one at a ``scale``): the claims of every
component, ready when all are, a K/V key of (component key, weight) pairs, the deltas if any component has them and
the drafter of the first component (request order) that has one. ``check_mix`` is the one rule for a mixture's
shape (count, weights, distinct ids), run by the API edge before any work and by the engine for other callers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from service.adapters.common.part import Binding, PartClaim
from service.errors import InvalidRequest, LoraplexError

_NOTHING = Binding()

MAX_ADAPTER_WEIGHT = 8.0
"""The largest |weight| (or |scale|) a request may put on an adapter: past it a delta outgrows the base weights it
corrects (docs/limits.md)."""


def check_weight(weight: float, field: str) -> None:
    """``InvalidRequest`` naming ``field`` unless ``weight`` is finite and at most ``MAX_ADAPTER_WEIGHT`` in size."""
    if not abs(weight) <= MAX_ADAPTER_WEIGHT:  # NaN fails this too
        raise InvalidRequest(
            f"{field} must be a finite number in [-{MAX_ADAPTER_WEIGHT:g}, {MAX_ADAPTER_WEIGHT:g}], got {weight}",
            field=field,
            limit=MAX_ADAPTER_WEIGHT,
        )


def check_mix(mix: Sequence[tuple[str, float]], limit: int, field: str = "adapters", *, zero_ok: bool = False) -> None:
    """A mixture's shape: 1 to ``limit`` adapters (``--max-mixture-adapters``), distinct ids, each weight within
    ``check_weight`` and, unless ``zero_ok``, non-zero (on the wire a zero weight is what an unset one reads as; a
    domain mix, e.g. ``adapter_scale`` 0, may weigh an adapter 0: PEFT's scaling set to 0)."""
    if len(mix) > limit:
        raise InvalidRequest(
            f"{field} has {len(mix)} adapters; this server mixes at most {limit} (--max-mixture-adapters)",
            field=field,
            limit=limit,
        )
    seen: set[str] = set()
    for i, (adapter_id, weight) in enumerate(mix):
        if adapter_id in seen:
            raise InvalidRequest(f"{field}[{i}].id repeats an adapter of the mixture", field=f"{field}[{i}].id")
        seen.add(adapter_id)
        check_weight(weight, f"{field}[{i}].weight")
        if weight == 0 and not zero_ok:
            raise InvalidRequest(
                f"{field}[{i}].weight is 0 (unset?): give each adapter a non-zero weight, or leave it out",
                field=f"{field}[{i}].weight",
            )


class MixtureKey(tuple[tuple[Hashable, float], ...]):
    """A ``Mixture``'s K/V key: (component key, weight) per component. It compares and hashes as the plain tuple;
    its own type lets ``involves`` tell it from a kind's key that happens to be a tuple."""

    __slots__ = ()


def involves(kv_key: Hashable, component: Hashable) -> bool:
    """Whether K/V keyed ``kv_key`` was shaped by the registration keyed ``component``: it is that key, or the key
    of a mixture or scale that lists it (what the engine's caches must drop when the registration goes)."""
    if kv_key == component:
        return True
    return isinstance(kv_key, MixtureKey) and any(key == component for key, _ in kv_key)


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

    @property
    def components(self) -> tuple[str, ...]:
        """The registered adapters this object holds (one; a ``Mixture`` several), in request order."""
        return (self.id,)

    def __repr__(self) -> str:
        parts = ", ".join(type(c).__name__ for c in self._claims)
        return f"Adapter({self.id!r}, parts=[{parts}], ready={self.ready()})"


class Mixture(Adapter):
    """One request's view of several adapters at weights, or of one at a scale (see the module docstring). Its
    ``id`` is the first component's: what metrics and logs label the request by."""

    __slots__ = ("weighted",)

    def __init__(self, weighted: Sequence[tuple[Adapter, float]]) -> None:
        # Claims in request order: ``binding`` merges them so, giving the first component's drafter.
        super().__init__(weighted[0][0].id, [c for adapter, _ in weighted for c in adapter._claims])
        self.weighted = tuple(weighted)

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(adapter.id for adapter, _ in self.weighted)

    def kv_key(self) -> Hashable | None:
        """(component key, weight) of every component that changes the K/V: no two scales or mixtures share K/V.
        None when no component changes it (heads only)."""
        keys = MixtureKey((key, w) for adapter, w in self.weighted if (key := adapter.kv_key()) is not None)
        return keys or None

    def __repr__(self) -> str:
        return f"Mixture({[(a.id, w) for a, w in self.weighted]!r}, ready={self.ready()})"


__all__ = ["MAX_ADAPTER_WEIGHT", "Adapter", "Mixture", "MixtureKey", "check_mix", "check_weight", "involves"]
