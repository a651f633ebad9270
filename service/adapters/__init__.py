"""LoRA adapters: formats, registry, tiered per-layer cache (the store) and the batched math.

Public names are re-exported here; the implementation lives in the submodules.
"""

from __future__ import annotations

from service.adapters.common.ids import check_adapter_id
from service.adapters.handle import Adapter
from service.adapters.lora.peft import LoraAdapterConfig, read_lora_config
from service.adapters.lora.registry import index_adapter
from service.adapters.lora.spec import AdapterSpec
from service.adapters.lora.store import AdapterInfo, AdapterState, AdapterStore, StoreState
from service.adapters.lora.types import MODULES, LoraLayer, LoraModule

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
