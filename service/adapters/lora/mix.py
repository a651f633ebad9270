"""Weighted adapters as one row's deltas: a per-request ``scale`` and mixtures of several adapters, composed from
the components' loaded layers, never merged into the base weights.

A row's key is its request's weighted adapters, ``((id, weight), ...)``. One adapter at weight 1 is the adapter's
own layer object (no copy: every plain LoRA row stays as it was). Anything else is composed once per key and layer
into one ``LoraLayer`` the batched math reads like any adapter's:

- one adapter at weight ``w``: ``a`` shared, ``b`` and the bias times ``w``; a DoRA module's per-channel factor is
  recomputed for that weight (``DoraNorm.rescale(w)``), as PEFT recomputes the norm with the changed scaling;
- several adapters: per module, the components' ``a`` stacked along the rank axis and their ``b`` side by side,
  each times its weight, so ``b_mix @ a_mix = Σ w_i · b_i @ a_i`` — exactly PEFT's ``add_weighted_adapter(...,
  combination_type="cat")``; trained biases summed with their weights. DoRA modules and trained replacements
  (``modules_to_save``) have no weighted sum: the frontend refuses them in a mixture of two or more, and
  ``compose`` refuses them again.

``Mixer`` keeps the composed layers of the most recent keys (``capacity`` keys, least recently used out), each
with weak references to the component layers it was built from, so a reloaded component is composed anew and an
evicted one is never kept alive by a mixture. It runs on the engine thread.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from service.adapters.lora.types import MODULES, EmbedLora, LoraLayer, LoraModule, LoraTop
from service.errors import InvalidRequest

Mix = tuple[tuple[str, float], ...]
_Refs = tuple[weakref.ReferenceType[object] | None, ...]


def _weighted(module: LoraModule, weight: float) -> LoraModule:
    """One module at ``weight`` (DoRA's factor recomputed for it)."""
    if weight == 1.0:
        return module
    bias = None if module.bias is None else module.bias * weight
    rescale = None if module.dora is None else module.dora.rescale(weight)
    return LoraModule(a=module.a, b=module.b * weight, bias=bias, rescale=rescale)


def _stacked(present: Sequence[tuple[LoraModule, float]], what: str) -> LoraModule:
    if len(present) == 1:
        return _weighted(*present[0])
    if any(m.dora is not None for m, _ in present):
        raise InvalidRequest(f"{what}: a DoRA adapter has no weighted sum with another adapter", field="adapters")
    a = torch.cat([m.a for m, _ in present])  # [sum r, in]
    b = torch.cat([m.b * w for m, w in present], dim=1)  # [out, sum r]
    biases = [m.bias * w for m, w in present if m.bias is not None]
    bias = None if not biases else torch.stack(biases).sum(0)
    return LoraModule(a=a, b=b, bias=bias)


def _nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def compose_layer(parts: Sequence[tuple[LoraLayer, float]]) -> LoraLayer:
    """The weighted sum of ``parts``' deltas as one layer (see the module docstring)."""
    modules: dict[str, LoraModule] = {}
    for name in MODULES:
        present = [(layer.modules[name], w) for layer, w in parts if name in layer.modules]
        if present:
            modules[name] = _stacked(present, name)
    norms: dict[str, Tensor] = {}
    for layer, _ in parts:
        for name, weight in layer.norms.items():
            if name in norms or len(parts) > 1:
                raise InvalidRequest(
                    f"{name}: a trained replacement (modules_to_save) cannot be mixed", field="adapters"
                )
            norms[name] = weight
    size = _nbytes(*(t for m in modules.values() for t in (m.a, m.b, m.bias, m.rescale)), *norms.values())
    return LoraLayer(modules=modules, nbytes=size, norms=norms)


def compose_top(parts: Sequence[tuple[LoraTop, float]]) -> LoraTop:
    """The weighted sum of ``parts``' model-level deltas; a trained replacement is taken as it is (PEFT's scaling
    never touches ``modules_to_save``), and only from an adapter alone."""
    embeds = [(t.embed, w) for t, w in parts if t.embed is not None]
    embed = None
    if embeds:
        embed = EmbedLora(
            a_t=torch.cat([e.a_t for e, _ in embeds], dim=1),  # [vocab, sum r]
            b=torch.cat([e.b * w for e, w in embeds], dim=1),  # [hidden, sum r]
        )
    heads = [(t.head, w) for t, w in parts if t.head is not None]
    head = _stacked(heads, "lm_head") if heads else None
    replaced = [t for t, _ in parts if t.embed_tokens is not None or t.lm_head is not None or t.norm is not None]
    if replaced and len(parts) > 1:
        raise InvalidRequest("a trained replacement (modules_to_save) cannot be mixed", field="adapters")
    saved = replaced[0] if replaced else LoraTop()
    tensors = (*(() if embed is None else (embed.a_t, embed.b)), *(() if head is None else (head.a, head.b)))
    return LoraTop(embed, head, saved.embed_tokens, saved.lm_head, saved.norm, nbytes=_nbytes(*tensors))


class Mixer:
    """Row keys -> the batched math's per-layer and model-level objects (see the module docstring)."""

    TOP = -1  # the cache's layer index of the model-level parts

    def __init__(
        self,
        layer: Callable[[str, int], LoraLayer | None],
        top: Callable[[str], LoraTop | None],
        *,
        capacity: int = 64,
    ) -> None:
        self._layer = layer
        self._top = top
        self.capacity = capacity
        self._kept: OrderedDict[Mix, dict[int, tuple[_Refs, object]]] = OrderedDict()
        self.compositions = 0  # layers composed (tests, benchmarks)

    @staticmethod
    def plain(key: Mix) -> str | None:
        """The adapter id of a key that is one adapter at weight 1 (its own layers serve it), else None."""
        return key[0][0] if len(key) == 1 and key[0][1] == 1.0 else None

    def layer(self, key: Hashable, layer: int) -> LoraLayer | None:
        """The row key's deltas for ``layer`` (None: no component touches it)."""
        mix: Mix = key  # type: ignore[assignment]
        adapter = self.plain(mix)
        if adapter is not None:
            return self._layer(adapter, layer)
        parts = [(self._layer(i, layer), w) for i, w in mix]
        return self._kept_or(mix, layer, parts, compose_layer)  # type: ignore[arg-type,return-value]

    def top(self, key: Hashable) -> LoraTop | None:
        """The row key's model-level parts (None: no component has any)."""
        mix: Mix = key  # type: ignore[assignment]
        adapter = self.plain(mix)
        if adapter is not None:
            return self._top(adapter)
        parts = [(self._top(i), w) for i, w in mix]
        return self._kept_or(mix, self.TOP, parts, compose_top)  # type: ignore[arg-type,return-value]

    def _kept_or(
        self, mix: Mix, index: int, parts: list[tuple[object | None, float]], compose: Callable[..., object]
    ) -> object | None:
        present = [(p, w) for p, w in parts if p is not None]
        if not present:
            return None
        refs: _Refs = tuple(None if p is None else weakref.ref(p) for p, _ in parts)
        kept = self._kept.get(mix)
        if kept is not None:
            self._kept.move_to_end(mix)
            hit = kept.get(index)
            if hit is not None and _same(hit[0], parts):
                return hit[1]
        else:
            kept = self._kept[mix] = {}
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        made = compose(present)
        kept[index] = (refs, made)
        self.compositions += 1
        return made

    def clear(self) -> None:
        self._kept.clear()


def _same(refs: _Refs, parts: Sequence[tuple[object | None, float]]) -> bool:
    return all(
        (ref is None) if p is None else (ref is not None and ref() is p)
        for ref, (p, _) in zip(refs, parts, strict=True)
    )


__all__ = ["Mix", "Mixer", "compose_layer", "compose_top"]
