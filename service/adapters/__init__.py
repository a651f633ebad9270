"""LoRA adapters: formats, registry, tiered per-layer cache (the store) and the batched math.

Public names are re-exported here; the implementation lives in the submodules.
"""

from __future__ import annotations

from service.adapters.types import MODULES, LoraLayer, LoraModule

__all__ = [
    "MODULES",
    "LoraLayer",
    "LoraModule",
]
