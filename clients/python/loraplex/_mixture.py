"""Adapter strength and mixtures as ``loraplex.v1`` fields, from the ``adapter_scale`` / ``adapters`` keywords.

``adapters`` is a list of ``WeightedAdapter`` or ``(id, weight)`` pairs: the exact weighted sum of those
adapters' deltas (PEFT's ``add_weighted_adapter(combination_type="cat")``). What the client can see is wrong
(types, non-finite or zero weights, repeated ids, ``adapter_scale`` beside ``adapters`` or without an adapter,
``adapter`` other than the first of ``adapters``) raises ``TypeError`` / ``ValueError`` before any RPC; the server's
bounds (``--max-mixture-adapters``, |weight| <= 8, registered ids, no DoRA in a mixture) are the server's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from loraplex._types import WeightedAdapter
from loraplex.v1 import generation_pb2


def _weight(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def weighted_adapters(adapters: object) -> list[generation_pb2.WeightedAdapter]:
    """``adapters`` as messages, in order (``[]`` for None or an empty list)."""
    if adapters is None:
        return []
    if isinstance(adapters, (str, bytes)) or not isinstance(adapters, Sequence):
        raise TypeError("adapters must be a list of WeightedAdapter or (id, weight) pairs")
    out: list[generation_pb2.WeightedAdapter] = []
    seen: set[str] = set()
    for i, item in enumerate(adapters):
        if isinstance(item, WeightedAdapter):
            adapter_id, weight = item.id, item.weight
        elif isinstance(item, tuple) and len(item) == 2:
            adapter_id, weight = item
        else:
            raise TypeError(f"adapters[{i}] must be a WeightedAdapter or an (id, weight) pair")
        if not isinstance(adapter_id, str) or not adapter_id:
            raise TypeError(f"adapters[{i}] id must be a non-empty str")
        if adapter_id in seen:
            raise ValueError(f"adapters[{i}] repeats adapter {adapter_id!r}")
        seen.add(adapter_id)
        w = _weight(f"adapters[{i}] weight", weight)
        if w == 0:
            raise ValueError(f"adapters[{i}] weight is 0: leave the adapter out instead")
        out.append(generation_pb2.WeightedAdapter(id=adapter_id, weight=w))
    return out


def mixture_fields(adapter: str, adapter_scale: object, adapters: object) -> tuple[str, dict[str, object]]:
    """The request's adapter id (``adapter``, or the first of ``adapters``: what the routing header carries) and the
    ``adapter_scale`` / ``adapters`` fields to set."""
    mixture = weighted_adapters(adapters)
    fields: dict[str, object] = {}
    if adapter_scale is not None:
        if mixture:
            raise ValueError("adapter_scale and adapters exclude each other: weigh each adapter in adapters")
        if not adapter:
            raise ValueError("adapter_scale needs an adapter")
        fields["adapter_scale"] = _weight("adapter_scale", adapter_scale)
    if mixture:
        first = mixture[0].id
        if adapter and adapter != first:
            raise ValueError(f"adapter {adapter!r} must be the first of adapters ({first!r}) or left out")
        adapter = first
        fields["adapters"] = mixture
    return adapter, fields


__all__ = ["mixture_fields", "weighted_adapters"]
