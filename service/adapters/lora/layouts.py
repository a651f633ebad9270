"""The shapes of the batched LoRA math's tables (``service.adapters.lora.tables``): where each PEFT module sits in
the fused projections, what a set of rows needs of a (layer, site) table, and the tables themselves.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from torch import Tensor

from service.adapters.lora.types import MODULES, LoraLayer
from service.kernels.lora import LoraSite
from service.model.config import ModelConfig
from service.model.llama import ProjName

SITES: Final[dict[ProjName, tuple[str, ...]]] = {
    "wqkv": ("q_proj", "k_proj", "v_proj"),
    "wo": ("o_proj",),
    "w13": ("gate_proj", "up_proj"),
    "w2": ("down_proj",),
}


@dataclass(frozen=True)
class ModuleSpec:
    """A PEFT module's place in the model: its input size and its output columns in the fused projection."""

    name: str
    cols: tuple[int, int]  # output columns of the fused projection
    in_features: int
    out_features: int


def module_layout(cfg: ModelConfig) -> dict[str, ModuleSpec]:
    """Each PEFT module's input size and output columns within its fused projection."""
    fused = cfg.fused_rows()
    hidden, inter, attn = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    layout: dict[str, ModuleSpec] = {}
    for part in fused["wqkv"]:
        layout[part.hf_name] = ModuleSpec(part.hf_name, (part.start, part.stop), hidden, part.stop - part.start)
    layout["o_proj"] = ModuleSpec("o_proj", (0, hidden), attn, hidden)
    for part in fused["w13"]:
        layout[part.hf_name] = ModuleSpec(part.hf_name, (part.start, part.stop), hidden, part.stop - part.start)
    layout["down_proj"] = ModuleSpec("down_proj", (0, hidden), inter, hidden)
    return layout


@dataclass(frozen=True)
class Need:
    """What a set of rows needs of a (layer, site) table: per module the widest rank, and which modules carry a
    DoRA scale or a trained bias in some row."""

    ranks: dict[str, int]  # module -> rank, in fused column order
    scaled: frozenset[str]
    biased: frozenset[str] = frozenset()

    def covered_by(self, other: Need) -> bool:
        ranks_fit = all(r <= other.ranks.get(m, 0) for m, r in self.ranks.items())
        return ranks_fit and self.scaled <= other.scaled and self.biased <= other.biased

    def grown(self, table: Need) -> Need:
        """What to reallocate when ``table`` does not cover this need: these modules and scales, each module at
        least as wide as the table had it (so the next few rows with a wider rank fit without another relayout)."""
        ranks = {m: max(r, table.ranks.get(m, 0)) for m, r in self.ranks.items()}
        return Need(ranks, self.scaled, self.biased)


@dataclass
class SlotTable:
    """Per-slot (layer, site) table: ``a`` [S, R, in] (a view of [S, in, R] storage on the eager path) and per
    module ``bt`` [S, r_m, out_m], R = sum of r_m; per module that needs one, ``scale`` [S, out_m] (ones in rows
    without DoRA) and ``bias`` [S, out_m] (zeros in rows without a trained bias)."""

    ranks: dict[str, int]  # module -> padded rank r_m, in fused column order
    offsets: dict[str, int]  # module -> first row of its segment along ``a``'s rank axis
    a: Tensor
    bt: dict[str, Tensor]
    scale: dict[str, Tensor] = field(default_factory=dict)
    bias: dict[str, Tensor] = field(default_factory=dict)
    kernel: LoraSite | None = None  # prepared for the compiled kernel on first use; reset when a tensor is replaced

    @property
    def width(self) -> int:
        return sum(self.ranks.values())

    @property
    def need(self) -> Need:
        return Need(dict(self.ranks), frozenset(self.scale), frozenset(self.bias))

    def tensors(self) -> list[Tensor]:
        return [self.a, *self.bt.values(), *self.scale.values(), *self.bias.values()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class Segment:
    """One module's part of a shared table: its columns ``[start, stop)`` of ``h``, ``bt`` [G, r_m, out_m] (the
    scaled B^T) and, where some adapter of the set is DoRA, ``scale`` [G, out_m]; where one has a trained bias,
    ``bias`` [G, out_m] (zeros for the others)."""

    module: str
    start: int
    stop: int
    bt: Tensor
    scale: Tensor | None = None
    bias: Tensor | None = None


@dataclass
class SharedTable:
    """Shared (layer, site) table of a set of G distinct adapters, stacked for grouped ``bmm``: ``a`` [G, R, in]
    (each adapter's modules' A along the rank axis, ranks zero-padded to the widest in the set, absent modules zero)
    and one ``Segment`` per module."""

    a: Tensor
    segs: list[Segment]
    kernel: LoraSite | None = None  # prepared for the compiled kernel on first use

    @property
    def nbytes(self) -> int:
        extras = [t for s in self.segs for t in (s.bt, s.scale, s.bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in (self.a, *extras))


@dataclass
class TableStats:
    """Counters for tests and benchmarks: how much copying the steps caused."""

    slot_writes: int = 0  # (layer, slot) pairs rewritten because their adapter changed
    relayouts: int = 0  # per-slot (layer, site) tables reallocated: the set of modules or ranks changed
    shared_builds: int = 0  # layers whose shared tables were rebuilt: the set of adapters changed


Refs = tuple[weakref.ReferenceType[LoraLayer] | None, ...]  # the layer objects something was built from


def refs_of(layers: Sequence[LoraLayer | None]) -> Refs:
    """Weak references to ``layers`` (None stays None): what a table or a composed layer was built from, without
    keeping an evicted adapter's weights alive."""
    return tuple(None if lora is None else weakref.ref(lora) for lora in layers)


def same_objects(refs: Refs, layers: Sequence[LoraLayer | None]) -> bool:
    """Whether ``refs`` point at exactly ``layers`` (the same objects, in order): nothing was reloaded or evicted."""
    if len(refs) != len(layers):
        return False
    return all(
        (ref is None) if lora is None else (ref is not None and ref() is lora)
        for ref, lora in zip(refs, layers, strict=True)
    )


def needs_of(site: str, rows: Sequence[LoraLayer | None]) -> Need:
    """What ``rows`` need of the site's table."""
    ranks: dict[str, int] = {}
    scaled: set[str] = set()
    biased: set[str] = set()
    for lora in rows:
        if lora is None:
            continue
        for name in SITES[site]:  # type: ignore[index]
            module = lora.modules.get(name)
            if module is None:
                continue
            ranks[name] = max(ranks.get(name, 0), module.rank)
            if module.rescale is not None:
                scaled.add(name)
            if module.bias is not None:
                biased.add(name)
    ordered = {m: ranks[m] for m in MODULES if m in ranks}
    return Need(ordered, frozenset(scaled), frozenset(biased))


__all__ = [
    "SITES",
    "ModuleSpec",
    "Need",
    "Refs",
    "Segment",
    "SharedTable",
    "SlotTable",
    "TableStats",
    "module_layout",
    "needs_of",
    "refs_of",
    "same_objects",
]
