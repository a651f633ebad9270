"""One view over every registered adapter: LoRA weights (``AdapterStore``) and Medusa heads (``MedusaRegistry``).

An adapter id names a folder holding a PEFT LoRA (``adapter_config.json``), Medusa heads (``config.json`` with
``medusa_num_heads``) or both; the folder is given as a path or as ``hf://org/name[@revision]``, a snapshot in the
local Hugging Face cache (``service.hf_cache``, resolved on disk before the path policy applies). Registration
indexes each part it finds (config + headers only) and is all or nothing: when the LoRA part of a Medusa + LoRA
folder is refused, the heads are not left registered either. The catalog remembers each adapter's source as given
(``source_of``: what the API reports) next to the folder its parts index (what the API reports as resolved).
``resolve`` turns an id into a per-request ``Adapter`` object; callers branch on its capabilities, never on a kind.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from pathlib import Path

from service.adapters.handle import Adapter
from service.adapters.ids import check_adapter_id
from service.adapters.registry import resolve_source
from service.adapters.store import AdapterStore
from service.adapters.types import AdapterInfo, LoraLayer
from service.errors import AdapterNotFound, InvalidAdapter, LoraplexError
from service.hf_cache import DEFAULT_HUB_CACHE, AdapterSource, source_folder
from service.medusa.format import CONFIG_FILE as MEDUSA_CONFIG
from service.medusa.format import is_medusa_folder
from service.medusa.registry import MedusaRegistry

LORA_CONFIG = "adapter_config.json"


class AdapterCatalog:
    def __init__(self, store: AdapterStore, medusa: MedusaRegistry, *, hub_cache: Path = DEFAULT_HUB_CACHE) -> None:
        self.store = store
        self.medusa = medusa
        self.hub_cache = hub_cache  # where hf:// sources are looked up
        self._given: dict[str, AdapterSource] = {}  # id -> the source it was registered from, as given
        self._unregistered: list[Callable[[Hashable], None]] = []  # told each removed registration's K/V key

    @property
    def roots(self) -> tuple[Path, ...]:
        return self.store.roots

    def register(self, adapter_id: str, source: AdapterSource) -> Adapter:
        """Index the folder ``source`` names (a path, or a ``HubRef`` resolved in ``hub_cache``) as ``adapter_id``."""
        check_adapter_id(adapter_id)
        folder = resolve_source(source_folder(source, self.hub_cache), self.store.roots)
        for marker in (MEDUSA_CONFIG, LORA_CONFIG):  # read below: a symlink out of the roots is refused first
            resolve_source(folder / marker, self.store.roots)
        heads = is_medusa_folder(folder)
        lora = (folder / LORA_CONFIG).is_file() or not heads  # no Medusa config: a LoRA folder (or an error)
        if heads:
            self.medusa.register(adapter_id, folder)
        if lora:
            try:
                self.store.register(adapter_id, folder)
            except Exception:
                if heads:
                    self.medusa.unregister(adapter_id)
                raise
        if not heads and not lora:
            raise InvalidAdapter(f"neither {LORA_CONFIG} nor a Medusa config.json", file=folder)
        self._given[adapter_id] = source
        return self.resolve(adapter_id)

    def source_of(self, adapter_id: str) -> str | None:
        """The source ``adapter_id`` was registered from, as given: a path, or ``hf://org/name[@revision]``
        (None for an adapter registered below the catalog, straight into its store or registry)."""
        given = self._given.get(adapter_id)
        return None if given is None else str(given)

    def prefetch(self, adapter_id: str) -> None:
        """Start loading every part of a registered adapter that is not on the device yet (quiet on any error:
        the engine's admission reports it)."""
        try:
            adapter = self.resolve(adapter_id)
            if adapter.has_lora:
                self.store.prefetch(adapter_id)
            if adapter.has_heads:
                self.medusa.request(adapter_id)
        except LoraplexError:
            pass

    def unregister(self, adapter_id: str) -> None:
        """``FailedPrecondition`` while requests pin the LoRA part (nothing is removed then). Every
        ``on_unregister`` listener is then told the registration's K/V key (what the engine's caches keyed it by)."""
        adapter = self.resolve(adapter_id)
        key = adapter.kv_key()
        if adapter.has_lora:
            self.store.unregister(adapter_id)
        if adapter.has_heads:
            self.medusa.unregister(adapter_id)
        self._given.pop(adapter_id, None)
        if key is not None:
            for listener in self._unregistered:
                listener(key)

    def on_unregister(self, listener: Callable[[Hashable], None]) -> None:
        """Call ``listener(kv_key)`` after each adapter is removed (on the unregistering thread: keep it short)."""
        self._unregistered.append(listener)

    def has_lora(self, adapter_id: str) -> bool:
        try:
            self.store.get(adapter_id)
        except AdapterNotFound:
            return False
        return True

    def resolve(self, adapter_id: str) -> Adapter:
        """A per-request object for a registered adapter (``AdapterNotFound`` otherwise)."""
        lora, heads = self.has_lora(adapter_id), self.medusa.has(adapter_id)
        if not (lora or heads):
            raise AdapterNotFound(adapter_id)
        return Adapter(adapter_id, self.store if lora else None, self.medusa if heads else None)

    def layer(self, adapter_id: str, layer: int) -> LoraLayer | None:
        """The engine's per-layer lookup in the forward (valid for pinned adapters only; see ``AdapterStore.layer``)."""
        return self.store.layer(adapter_id, layer)

    def ids(self) -> list[str]:
        return sorted({i.id for i in self.store.list()} | set(self.medusa.ids()))

    def lora_info(self, adapter_id: str) -> AdapterInfo | None:
        return self.store.get(adapter_id) if self.has_lora(adapter_id) else None

    def close(self, timeout: float | None = None) -> None:
        """Stop the loaders (waiting up to ``timeout`` seconds for a LoRA load in progress)."""
        self.medusa.close()
        self.store.close(timeout)
