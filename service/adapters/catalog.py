"""One view over every registered adapter: the parts of each id, held by the kinds of ``service.adapters.kinds``.

An adapter id names a folder holding one or more parts (a PEFT LoRA, Medusa heads, or both); the folder is given
as a path or as ``hf://org/name[@revision]``, a snapshot in the local Hugging Face cache (``service.hf_cache``,
resolved on disk before the path policy applies). Registration asks each kind, in table order, whether the folder
is its own; a folder no kind claims goes to the last kind, whose registration names what is missing. It indexes
each part (config + headers only) and is all or nothing: when one part is refused, the parts registered before it
are removed again. Parts are removed in the reverse order (a kind that refuses while in use, LoRA, goes first,
before anything is removed). The catalog remembers each adapter's source as given (``source_of``: what the API
reports) next to the folder its parts index (what the API reports as resolved). ``resolve`` turns an id into a
per-request ``Adapter`` object with one claim per part (in removal order: a LoRA part's failure is reported
first); nothing below it asks which kind a part is. ``resolve_mix`` does so for a mixture (or one adapter at a
scale), refusing in a mixture of two or more what PEFT defines no weighted sum for: DoRA, modules_to_save.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from service.adapters.common.files import resolve_source
from service.adapters.common.ids import check_adapter_id
from service.adapters.common.part import PartKind
from service.adapters.handle import Adapter, Mixture, check_mix
from service.adapters.lora.part import LoraPart
from service.errors import AdapterNotFound, InvalidRequest, LoraplexError
from service.hf_cache import DEFAULT_HUB_CACHE, AdapterSource, source_folder

if TYPE_CHECKING:
    from service.adapters.lora.types import LoraLayer

K = TypeVar("K")


class AdapterCatalog:
    def __init__(
        self, kinds: Sequence[PartKind], *, roots: Sequence[Path] = (), hub_cache: Path = DEFAULT_HUB_CACHE
    ) -> None:
        if not kinds:
            raise ValueError("an adapter catalog needs at least one part kind")
        self.kinds = tuple(kinds)  # registration order; the last takes folders no kind claims
        self.roots = tuple(roots)  # the path policy (--adapter-root); empty: any readable folder
        self.hub_cache = hub_cache  # where hf:// sources are looked up
        self._given: dict[str, AdapterSource] = {}  # id -> the source it was registered from, as given
        self._unregistered: list[Callable[[Hashable], None]] = []  # told each removed registration's K/V key

    def kind(self, cls: type[K]) -> K | None:
        """The registered kind of type ``cls`` (for the API's per-kind details and tests), or None."""
        return next((k for k in self.kinds if isinstance(k, cls)), None)

    def register(self, adapter_id: str, source: AdapterSource) -> Adapter:
        """Index the folder ``source`` names (a path, or a ``HubRef`` resolved in ``hub_cache``) as ``adapter_id``."""
        check_adapter_id(adapter_id)
        folder = resolve_source(source_folder(source, self.hub_cache), self.roots)
        for kind in self.kinds:  # read below: a symlink out of the roots is refused first
            for marker in kind.markers:
                resolve_source(folder / marker, self.roots)
        owners = [kind for kind in self.kinds if kind.owns(folder)] or [self.kinds[-1]]
        done: list[PartKind] = []
        try:
            for kind in owners:
                kind.register(adapter_id, folder)
                done.append(kind)
        except Exception:
            for kind in reversed(done):
                kind.unregister(adapter_id)
            raise
        self._given[adapter_id] = source
        return self.resolve(adapter_id)

    def source_of(self, adapter_id: str) -> str | None:
        """The source ``adapter_id`` was registered from, as given: a path, or ``hf://org/name[@revision]``
        (None for an adapter registered below the catalog, straight into one of its kinds)."""
        given = self._given.get(adapter_id)
        return None if given is None else str(given)

    def prefetch(self, adapter_id: str) -> None:
        """Start loading every part of a registered adapter that is not on the device yet (quiet on any error:
        the engine's admission reports it)."""
        try:
            for kind in self._owners(adapter_id):
                kind.prefetch(adapter_id)
        except LoraplexError:
            pass

    def unregister(self, adapter_id: str) -> None:
        """``FailedPrecondition`` while requests pin a part that refuses then (nothing is removed). Every
        ``on_unregister`` listener is then told the registration's K/V key (what the engine's caches keyed it by)."""
        key = self.resolve(adapter_id).kv_key()
        for kind in reversed(self._owners(adapter_id)):
            kind.unregister(adapter_id)
        self._given.pop(adapter_id, None)
        if key is not None:
            for listener in self._unregistered:
                listener(key)

    def on_unregister(self, listener: Callable[[Hashable], None]) -> None:
        """Call ``listener(kv_key)`` after each adapter is removed (on the unregistering thread: keep it short)."""
        self._unregistered.append(listener)

    def resolve(self, adapter_id: str) -> Adapter:
        """A per-request object for a registered adapter (``AdapterNotFound`` otherwise)."""
        owners = self._owners(adapter_id)
        if not owners:
            raise AdapterNotFound(adapter_id)
        return Adapter(adapter_id, [kind.claim(adapter_id) for kind in reversed(owners)])

    def resolve_mix(self, mix: Sequence[tuple[str, float]], *, limit: int) -> Adapter:
        """A per-request object for adapters at weights (``check_mix``'s rule, at most ``limit`` of them). The
        first unknown id is ``AdapterNotFound``; in a mixture of two or more, a DoRA adapter or one with
        modules_to_save is ``InvalidRequest`` (a scale on it alone is fine). One adapter at weight 1 is that
        adapter as ``resolve`` gives it (its K/V key unchanged)."""
        check_mix(mix, limit, zero_ok=True)
        weighted = [(self.resolve(adapter_id), weight) for adapter_id, weight in mix]
        if len(mix) == 1 and mix[0][1] == 1.0:
            return weighted[0][0]
        if len(mix) > 1:
            for i, (adapter_id, _) in enumerate(mix):
                self._check_summable(adapter_id, f"adapters[{i}].id")
        return Mixture(weighted)

    def _check_summable(self, adapter_id: str, field: str) -> None:
        lora = self.kind(LoraPart)
        if lora is None or not lora.has(adapter_id):
            return
        info = lora.store.get(adapter_id)
        what = "DoRA (use_dora)" if info.dora else "modules_to_save" if info.saved_modules else None
        if what is not None:
            raise InvalidRequest(
                f"adapter {adapter_id!r} uses {what}: PEFT defines no weighted sum of it with other adapters; "
                "serve it alone (a scale is allowed)",
                field=field,
            )

    def layer(self, adapter_id: str, layer: int) -> LoraLayer | None:
        """The engine's per-layer lookup in the forward (valid while a request holds the adapter ready)."""
        for kind in self.kinds:
            deltas = kind.layer(adapter_id, layer)
            if deltas is not None:
                return cast("LoraLayer", deltas)
        return None

    def ids(self) -> list[str]:
        return sorted({i for kind in self.kinds for i in kind.ids()})

    def close(self, timeout: float | None = None) -> None:
        """Stop every kind's loaders (waiting up to ``timeout`` seconds for a load in progress where a kind can)."""
        for kind in self.kinds:
            kind.close(timeout)

    def _owners(self, adapter_id: str) -> list[PartKind]:
        return [kind for kind in self.kinds if kind.has(adapter_id)]


__all__ = ["AdapterCatalog"]
