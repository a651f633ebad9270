"""Medusa heads: the adapter format, the heads on a device, speculative verification and a reference loop.

Public names are re-exported here; the implementation lives in the submodules (``format``, ``heads``,
``speculative``, ``loop``).
"""

from __future__ import annotations

from service.medusa.format import MedusaConfig, MedusaSpec, index_medusa, is_medusa_folder, read_medusa_config
from service.medusa.heads import MedusaHeads
from service.medusa.loop import Generation, GenerationStats, generate
from service.medusa.speculative import PAD, Verified, verify_greedy, verify_sampling

__all__ = [
    "PAD",
    "Generation",
    "GenerationStats",
    "MedusaConfig",
    "MedusaHeads",
    "MedusaSpec",
    "Verified",
    "generate",
    "index_medusa",
    "is_medusa_folder",
    "read_medusa_config",
    "verify_greedy",
    "verify_sampling",
]
