"""The LoRA adapter kind: PEFT folders indexed at registration, a byte-budgeted tiered store, the batched math.

Public names are re-exported here; the implementation lives in the submodules. ``LoraPart`` is this kind's entry
in the catalog's registration table (``service.adapters.kinds``).
"""

from __future__ import annotations

from service.adapters.lora.peft import LoraAdapterConfig, read_lora_config
from service.adapters.lora.registry import index_adapter
from service.adapters.lora.spec import AdapterSpec
from service.adapters.lora.store import AdapterInfo, AdapterState, AdapterStore, StoreState
from service.adapters.lora.types import MODULES, LoraLayer, LoraModule

__all__ = [
    "MODULES",
    "AdapterInfo",
    "AdapterSpec",
    "AdapterState",
    "AdapterStore",
    "LoraAdapterConfig",
    "LoraLayer",
    "LoraModule",
    "StoreState",
    "index_adapter",
    "read_lora_config",
]
