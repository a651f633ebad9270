"""Medusa heads as an adapter part: the catalog's view of the ``MedusaRegistry`` (``PartKind``) and one request's
claim on a part (``PartClaim``).

A folder is a Medusa part when its ``config.json`` names ``medusa_num_heads``. Heads stay on the device until
unregistered, so a claim pins nothing: it is ready once the heads are loaded, and then binds one ``MedusaDrafter``
per loaded heads (rows of the same heads draft in one batch). Loads run on the registry's thread, never here.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable
from pathlib import Path

from service.adapters.common.part import Binding, PartUsage
from service.adapters.medusa.config import CONFIG_FILE, is_medusa_folder
from service.adapters.medusa.drafter import MedusaDrafter
from service.adapters.medusa.heads import MedusaHeads
from service.adapters.medusa.registry import MedusaRegistry
from service.drafters.tree import DraftTree
from service.errors import LoraplexError


class MedusaClaim:
    """One request's claim on Medusa heads (see the module docstring)."""

    __slots__ = ("_loaded", "_part", "id")

    def __init__(self, part: MedusaPart, adapter_id: str) -> None:
        self._part = part
        self.id = adapter_id
        self._loaded = False

    def load(self) -> None:
        if not self._loaded:
            self._loaded = self._part.registry.request(self.id)

    def release(self) -> None:
        pass  # heads are never evicted: nothing was pinned

    def ready(self) -> bool:
        return self._loaded

    def failure(self) -> LoraplexError | None:
        return self._part.registry.failure(self.id)

    def kv_key(self) -> Hashable | None:
        return None  # heads read the hidden states; they never change the K/V

    def drafts(self) -> bool:
        return True

    def binding(self) -> Binding:
        return Binding(drafter=self._part.drafter(self._part.registry.heads(self.id)))


class MedusaPart:
    """The Medusa kind in the catalog's table. ``tree`` (``--speculate-tree``) and ``threshold``
    (``--draft-threshold``) shape every drafter it binds."""

    markers: tuple[str, ...] = (CONFIG_FILE,)

    def __init__(self, registry: MedusaRegistry, *, tree: str = "chain", threshold: float = 0.0) -> None:
        self.registry = registry
        self.tree_spec = tree
        self.threshold = threshold
        self._trees: dict[int, DraftTree] = {}  # per head count
        self._drafters: weakref.WeakKeyDictionary[MedusaHeads, MedusaDrafter] = weakref.WeakKeyDictionary()

    def owns(self, folder: Path) -> bool:
        return is_medusa_folder(folder)

    def register(self, adapter_id: str, folder: Path) -> None:
        self.registry.register(adapter_id, folder)

    def unregister(self, adapter_id: str) -> None:
        self.registry.unregister(adapter_id)

    def has(self, adapter_id: str) -> bool:
        return self.registry.has(adapter_id)

    def ids(self) -> Iterable[str]:
        return self.registry.ids()

    def prefetch(self, adapter_id: str) -> None:
        self.registry.request(adapter_id)

    def claim(self, adapter_id: str) -> MedusaClaim:
        return MedusaClaim(self, adapter_id)

    def usage(self, adapter_id: str) -> PartUsage:
        loaded = self.registry.loaded(adapter_id)
        return PartUsage(self.registry.heads(adapter_id).nbytes if loaded else 0, 0, loaded)

    def layer(self, adapter_id: str, layer: int) -> None:
        return None  # heads change no layer of the forward

    def close(self, timeout: float | None = None) -> None:
        self.registry.close()

    def drafter(self, heads: MedusaHeads) -> MedusaDrafter:
        """The one drafter of ``heads`` (engine thread: made on the first row it binds)."""
        drafter = self._drafters.get(heads)
        if drafter is None:
            tree = self._trees.get(heads.num_heads)
            if tree is None:
                tree = self._trees[heads.num_heads] = DraftTree.parse(self.tree_spec, heads.num_heads)
            drafter = self._drafters[heads] = MedusaDrafter(heads, tree, self.threshold)
        return drafter


__all__ = ["MedusaClaim", "MedusaPart"]
