"""Weighted adapters as one row's deltas: a per-request ``scale`` and mixtures of several adapters, composed from
the components' loaded layers, never merged into the base weights.

A row's key is its request's weighted adapters, ``((id, weight), ...)``. One adapter at weight 1 is the adapter's
own layer object (no copy: every plain LoRA row stays as it was). Anything else is composed once per key and layer
into one ``LoraLayer`` the batched math reads like any adapter's:

- one adapter at weight ``w``: ``a`` shared, ``b`` times ``w``; a DoRA module's per-channel factor is recomputed
  for that weight (``DoraNorm.rescale(w)``), as PEFT recomputes the norm with the changed scaling;
- several adapters: per module, the components' ``a`` stacked along the rank axis and their ``b`` side by side,
  each times its weight (trained biases summed, each times its weight), so ``b_mix @ a_mix = Σ w_i · b_i @ a_i`` —
  exactly PEFT's ``add_weighted_adapter(...,
  combination_type="cat")`` (LoRA on embed_tokens / lm_head alike). DoRA and modules_to_save have no weighted sum
  with another adapter: the catalog refuses them in a mixture of two or more, and ``compose_layer`` again.

``Mixer`` keeps the composed layers of the most recent keys (``capacity`` keys, least recently used out), each
with weak references to the component layers it was built from, so a reloaded component is composed anew and an
evicted one is never kept alive by a mixture. It runs on the engine thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch

from service.adapters.lora.layouts import Refs, refs_of, same_objects
from service.adapters.lora.types import LoraLayer, LoraModule
from service.errors import InvalidRequest

Mix = tuple[tuple[str, float], ...]
AdapterLookup = Callable[[str, int], LoraLayer | None]  # one adapter's layer (the catalog's ``layer``)


def _weighted(module: LoraModule, weight: float) -> LoraModule:
    """One module at ``weight`` (DoRA's factor recomputed for it)."""
    if weight == 1.0:
        return module
    rescale = None if module.dora is None else module.dora.rescale(weight)
    bias = None if module.bias is None else module.bias * weight
    return LoraModule(a=module.a, b=module.b * weight, rescale=rescale, bias=bias)


def _stacked(present: Sequence[tuple[LoraModule, float]], what: str) -> LoraModule:
    if len(present) == 1:
        return _weighted(*present[0])
    if any(m.dora is not None for m, _ in present):
        raise InvalidRequest(f"{what}: a DoRA adapter has no weighted sum with another adapter", field="adapters")
    a = torch.cat([m.a for m, _ in present])  # [sum r, in]
    b = torch.cat([m.b * w for m, w in present], dim=1)  # [out, sum r]
    biases = [m.bias.float() * w for m, w in present if m.bias is not None]  # summed in fp32, rounded once
    bias = None if not biases else torch.stack(biases).sum(0).to(present[0][0].b.dtype)
    return LoraModule(a=a, b=b, bias=bias)


def compose_layer(parts: Sequence[tuple[LoraLayer, float]]) -> LoraLayer:
    """The weighted sum of ``parts``' deltas as one layer (see the module docstring). Saved modules are not
    weighted (PEFT's scale leaves them as trained): one part keeps its own; several parts cannot have any."""
    modules: dict[str, LoraModule] = {}
    for name in dict.fromkeys(n for layer, _ in parts for n in layer.modules):  # MODULES order, then the head's
        present = [(layer.modules[name], w) for layer, w in parts if name in layer.modules]
        modules[name] = _stacked(present, name)
    saved = parts[0][0].saved if len(parts) == 1 else {}
    if len(parts) > 1 and any(layer.saved for layer, _ in parts):
        raise InvalidRequest("a modules_to_save adapter has no weighted sum with another adapter", field="adapters")
    tensors = [t for m in modules.values() for t in (m.a, m.b, m.rescale, m.bias) if t is not None]
    nbytes = sum(t.numel() * t.element_size() for t in (*tensors, *saved.values()))
    return LoraLayer(modules=modules, nbytes=nbytes, saved=saved)


class Mixer:
    """Row keys -> the batched math's per-layer objects (see the module docstring)."""

    def __init__(self, layer: AdapterLookup, *, capacity: int = 64) -> None:
        self._layer = layer
        self.capacity = capacity
        self._kept: OrderedDict[Mix, dict[int, tuple[Refs, LoraLayer]]] = OrderedDict()

    def layer(self, key: Hashable, layer: int) -> LoraLayer | None:
        """The row key's deltas for ``layer`` (None: no component touches it)."""
        mix: Mix = key  # type: ignore[assignment]
        if len(mix) == 1 and mix[0][1] == 1.0:  # one adapter at weight 1: its own layers serve it
            return self._layer(mix[0][0], layer)
        parts = [(self._layer(i, layer), w) for i, w in mix]
        present = [(p, w) for p, w in parts if p is not None]
        if not present:
            return None
        components = [p for p, _ in parts]
        kept = self._kept.get(mix)
        if kept is not None:
            self._kept.move_to_end(mix)
            hit = kept.get(layer)
            if hit is not None and same_objects(hit[0], components):
                return hit[1]
        else:
            kept = self._kept[mix] = {}
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        made = compose_layer(present)
        kept[layer] = (refs_of(components), made)
        return made

    def clear(self) -> None:
        self._kept.clear()


__all__ = ["AdapterLookup", "Mix", "Mixer", "compose_layer"]
