"""LoRA adapters: formats, registry, tiered per-layer cache (the store) and the batched math.

Public names are re-exported here; the implementation lives in the submodules.
"""

from __future__ import annotations

from service.adapters.handle import Adapter
from service.adapters.ids import check_adapter_id
from service.adapters.peft import LoraAdapterConfig, read_lora_config
from service.adapters.registry import index_adapter
from service.adapters.spec import AdapterSpec
from service.adapters.store import AdapterInfo, AdapterState, AdapterStore, StoreState
from service.adapters.types import MODULES, LoraLayer, LoraModule

__all__ = [
    "MODULES",
    "Adapter",
    "AdapterInfo",
    "AdapterSpec",
    "AdapterState",
    "AdapterStore",
    "LoraAdapterConfig",
    "LoraLayer",
    "LoraModule",
    "StoreState",
    "check_adapter_id",
    "index_adapter",
    "read_lora_config",
]
