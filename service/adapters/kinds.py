"""The adapter kinds a server knows: one line per kind in ``PART_KINDS``, the catalog's registration table.

Each entry builds a kind's registry from the ``KindContext`` (the base model, device, dtype, settings and path
policy). Order matters twice: a folder is offered to the kinds in this order (the last takes a folder no kind
claims, and its registration names what is missing), and parts are removed in the reverse order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from service.adapters.catalog import AdapterCatalog
from service.adapters.common.files import resolve_source
from service.adapters.common.part import PartKind
from service.adapters.lora.part import LoraPart
from service.adapters.lora.store import AdapterStore
from service.adapters.lora.types import BaseWeights
from service.adapters.medusa.part import MedusaPart
from service.adapters.medusa.registry import MedusaRegistry
from service.config import Settings
from service.model.config import ModelConfig


@dataclass(frozen=True)
class KindContext:
    """What a kind's registry is built from."""

    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    settings: Settings
    roots: tuple[Path, ...]  # the path policy (--adapter-root); empty: any readable folder
    base: BaseWeights | None = None  # the base model's projection weights (DoRA's norms); None: DoRA refused

    def check_path(self, path: Path) -> Path:
        return resolve_source(path, self.roots)


def _medusa(ctx: KindContext) -> PartKind:
    registry = MedusaRegistry(ctx.model_config, device=ctx.device, dtype=ctx.dtype, check_path=ctx.check_path)
    return MedusaPart(registry, tree=ctx.settings.speculate_tree, threshold=ctx.settings.draft_threshold)


def _lora(ctx: KindContext) -> PartKind:
    s = ctx.settings
    return LoraPart(
        AdapterStore(
            ctx.model_config,
            device=ctx.device,
            dtype=ctx.dtype,
            roots=ctx.roots,
            device_budget_bytes=s.adapter_device_budget_bytes,
            host_budget_bytes=s.adapter_host_budget_bytes,
            base=ctx.base,
            max_saved_bytes=s.max_saved_module_bytes,
            # Only where the device tier is host memory: charging an accelerator's copies to the host budget would
            # let device memory outgrow its budget unbounded by any flag.
            overflow_adapters=s.adapter_overflow_adapters if ctx.device.type == "cpu" else 0,
        )
    )


PART_KINDS: tuple[Callable[[KindContext], PartKind], ...] = (
    _medusa,
    _lora,
)


def build_catalog(ctx: KindContext) -> AdapterCatalog:
    """A catalog holding one registry per kind of ``PART_KINDS``."""
    return AdapterCatalog([make(ctx) for make in PART_KINDS], roots=ctx.roots, hub_cache=ctx.settings.hf_hub_cache)


__all__ = ["PART_KINDS", "KindContext", "build_catalog"]
