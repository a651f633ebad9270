"""Medusa heads as served: the adapter format, the heads on a device, their registry and draft trees.

Public names are re-exported here from the submodules. The reference loop, chain verification and head training
live in ``tools.medusa`` and are never imported by the server.
"""

from __future__ import annotations

from service.adapters.medusa.format import MedusaConfig, MedusaSpec, index_medusa, is_medusa_folder, read_medusa_config
from service.adapters.medusa.heads import MedusaHeads

__all__ = [
    "MedusaConfig",
    "MedusaHeads",
    "MedusaSpec",
    "index_medusa",
    "is_medusa_folder",
    "read_medusa_config",
]
