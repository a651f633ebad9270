"""One view over every registered adapter: LoRA weights (``AdapterStore``) and Medusa heads (``MedusaRegistry``).

An adapter id names a folder holding a PEFT LoRA (``adapter_config.json``), Medusa heads (``config.json`` with
``medusa_num_heads``) or both. Registration indexes each part it finds (config + headers only) and is all or
nothing: when the LoRA part of a Medusa + LoRA folder is refused, the heads are not left registered either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from service.adapters.registry import check_adapter_id, resolve_source
from service.adapters.store import AdapterStore
from service.adapters.types import AdapterInfo
from service.errors import AdapterNotFound, InvalidAdapter, LoraplexError
from service.medusa.format import is_medusa_folder
from service.medusa.registry import MedusaRegistry

Kind = Literal["lora", "medusa", "medusa_lora"]
LORA_CONFIG = "adapter_config.json"


class AdapterCatalog:
    def __init__(self, store: AdapterStore, medusa: MedusaRegistry) -> None:
        self.store = store
        self.medusa = medusa

    @property
    def roots(self) -> tuple[Path, ...]:
        return self.store.roots

    def register(self, adapter_id: str, path: Path) -> Kind:
        check_adapter_id(adapter_id)
        folder = resolve_source(Path(path), self.store.roots)
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
        return self.kind(adapter_id)

    def prefetch(self, adapter_id: str) -> None:
        """Start loading every part of a registered adapter that is not on the device yet (quiet on any error:
        the engine's admission reports it)."""
        try:
            kind = self.kind(adapter_id)
            if kind != "medusa":
                self.store.prefetch(adapter_id)
            if kind != "lora":
                self.medusa.request(adapter_id)
        except LoraplexError:
            pass

    def unregister(self, adapter_id: str) -> None:
        """``FailedPrecondition`` while requests pin the LoRA part (nothing is removed then)."""
        kind = self.kind(adapter_id)
        if kind != "medusa":
            self.store.unregister(adapter_id)
        if kind != "lora":
            self.medusa.unregister(adapter_id)

    def has_lora(self, adapter_id: str) -> bool:
        try:
            self.store.get(adapter_id)
        except AdapterNotFound:
            return False
        return True

    def kind(self, adapter_id: str) -> Kind:
        lora, heads = self.has_lora(adapter_id), self.medusa.has(adapter_id)
        if lora and heads:
            return "medusa_lora"
        if heads:
            return "medusa"
        if lora:
            return "lora"
        raise AdapterNotFound(adapter_id)

    def ids(self) -> list[str]:
        return sorted({i.id for i in self.store.list()} | set(self.medusa.ids()))

    def lora_info(self, adapter_id: str) -> AdapterInfo | None:
        return self.store.get(adapter_id) if self.has_lora(adapter_id) else None

    def close(self) -> None:
        self.store.close()
        self.medusa.close()
