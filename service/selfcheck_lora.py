"""Random LoRA probes for the start-up self-check (``service.selfcheck``): adapters of every module of a layer's
layout, and their float32 reference delta per projection site."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from service.adapters.lora.batch import ModuleSpec
from service.adapters.lora.layouts import SITES
from service.adapters.lora.types import LoraLayer, LoraModule
from service.model.llama import ProjName

__all__ = ["Layout", "in_features", "out_features", "random_lora", "reference_delta", "site_modules"]

Layout = dict[str, ModuleSpec]


def random_lora(layout: Layout, rank: int, gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> LoraLayer:
    modules = {}
    for name, spec in layout.items():
        a = torch.randn(rank, spec.in_features, generator=gen) / math.sqrt(spec.in_features)
        b = torch.randn(spec.out_features, rank, generator=gen) / math.sqrt(rank)
        modules[name] = LoraModule(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
    nbytes = sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in modules.values())
    return LoraLayer(modules, nbytes)


def site_modules(layout: Layout, site: ProjName) -> list[ModuleSpec]:
    return [layout[m] for m in SITES[site]]


def in_features(layout: Layout, site: ProjName) -> int:
    return site_modules(layout, site)[0].in_features


def out_features(layout: Layout, site: ProjName) -> int:
    return max(spec.cols[1] for spec in site_modules(layout, site))


def reference_delta(lora: LoraLayer, layout: Layout, site: ProjName, x: Tensor) -> Tensor:
    """float32 x [T, in] -> the site's fused delta [T, out]."""
    out = torch.zeros(x.shape[0], out_features(layout, site), device=x.device)
    for spec in site_modules(layout, site):
        m = lora.modules[spec.name]
        out[:, spec.cols[0] : spec.cols[1]] += x @ m.a.float().t() @ m.b.float().t()
    return out
