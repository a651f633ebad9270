"""The batched LoRA math: one engine step's rows, each with its own adapter (or none), through one forward pass.

Public API::

    SITES: dict[ProjName, tuple[str, ...]]         fused projection -> the PEFT modules whose outputs it holds
    LoraSlots(cfg, *, device, dtype)               per-KV-slot LoRA weights, kept across engine steps
        .nbytes, .layouts(), .stats, .clear()
    AdapterBatch.build(row_adapters, layer_lookup, slots, *, slot_start=0, rows_per_item=1) -> AdapterBatch | None
    AdapterBatch.add_delta(out, x, layer, name) -> out        (the model's ``AdapterHook``)
    AdapterBatch.delta(layer, site, x) -> Tensor | None

How a delta is computed. Every KV slot ``s`` owns a row of a per-(layer, site) table laid out for ``torch.bmm``:
``at[s]`` = the slot's adapter's ``A^T`` for every module of the site side by side ``[in, R]``, and per module
``bt[m][s]`` = its scaled ``B^T`` ``[r_m, out_m]``; ranks are zero-padded to the widest adapter in use and absent
modules are zero. A step over rows ``[lo, hi)`` then costs one ``bmm`` for the site's A side plus one ``bmm`` and
one add per module, whatever the number of distinct adapters, ranks or target subsets: ``h = x @ at`` ``[B, T, R]``
and ``out[..., cols_m] += h[..., seg_m] @ bt[m]``. Zero weights give a delta of exactly zero, so a base-only row
inside the span is unchanged bit for bit, and rows outside the span of adapter rows are not touched at all. A batch
with no adapter row has no ``AdapterBatch`` (``build`` returns ``None``) and pays nothing.

Why this layout (measured with ``bench/adapters_math.py``, SmolLM2 shapes, 32 rows, 32 adapters, fp32 CPU): a loop
over adapter groups costs ~8x more (Python and kernel overhead per group), the "segmented" dense form (all active
adapters' A concatenated, rows masked) ~9x more (every row multiplies every adapter), a per-step gather of
stacked weights ~2x more; the per-slot table costs a bmm on data already in place. The table survives across
steps because a decode step changes few rows: the engine keeps rows compacted in slots, so a retiring request
changes one slot and an admitted one fills one; only slots whose adapter (``LoraLayer`` object) changed are
rewritten. Its memory is one adapter's layer weights per slot and per layer (``LoraSlots.nbytes``).

On CPU the table and the two small matmuls are kept in fp32 even when the model runs in bf16/fp16: CPU bmm in bf16
is ~10x slower than fp32 at these shapes, and the weights are small. On CUDA the table uses the model dtype.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import torch
from torch import Tensor

from service.adapters.types import MODULES, LoraLayer
from service.errors import InvalidAdapter
from service.model.config import ModelConfig
from service.model.llama import ProjName

SITES: Final[dict[ProjName, tuple[str, ...]]] = {
    "wqkv": ("q_proj", "k_proj", "v_proj"),
    "wo": ("o_proj",),
    "w13": ("gate_proj", "up_proj"),
    "w2": ("down_proj",),
}

LayerLookup = Callable[[str, int], LoraLayer | None]


class _Dirty:
    """Marks a slot whose table rows hold unknown contents (after a relayout): any use rewrites it."""


_DIRTY: Final = _Dirty()
_Owner = weakref.ReferenceType[LoraLayer] | _Dirty | None  # None: the slot's rows are zeros


@dataclass(frozen=True)
class _Module:
    name: str
    cols: tuple[int, int]  # output columns of the fused projection
    in_features: int
    out_features: int


@dataclass
class _SiteTable:
    """One (layer, site) table: ``at`` [S, in, R] and per module ``bt`` [S, r_m, out_m], R = sum of r_m."""

    ranks: dict[str, int]  # module -> padded rank r_m, in fused column order
    offsets: dict[str, int]  # module -> first column of its segment in ``at``'s last dimension
    at: Tensor
    bt: dict[str, Tensor]

    @property
    def width(self) -> int:
        return sum(self.ranks.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.at, *self.bt.values()))


@dataclass
class SlotStats:
    """Counters for tests and benchmarks: how much copying the steps caused."""

    slot_writes: int = 0  # (layer, slot) pairs rewritten because their adapter changed
    relayouts: int = 0  # (layer, site) tables reallocated because the set of modules or ranks changed


class LoraSlots:
    """Per-KV-slot LoRA weights laid out for ``bmm``, owned by the engine and reused by every step's batch.

    Holds weak references to the ``LoraLayer`` objects it copied from, so it never keeps evicted adapter weights
    alive, and notices when the store hands out a new object (reload, new adapter in a slot).
    """

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        # CPU bmm in half precision is far slower than fp32 at LoRA shapes; the tables are small.
        half = dtype in (torch.bfloat16, torch.float16)
        self.compute_dtype = torch.float32 if self.device.type == "cpu" and half else dtype
        self.modules = _module_layout(cfg)
        self.stats = SlotStats()
        self._capacity = 0
        self._tables: list[dict[str, _SiteTable]] = [{} for _ in range(cfg.num_layers)]
        self._owners: list[list[_Owner]] = [[] for _ in range(cfg.num_layers)]

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def nbytes(self) -> int:
        """Bytes held by all tables."""
        return sum(t.nbytes for tables in self._tables for t in tables.values())

    def layouts(self) -> dict[tuple[int, str], dict[str, int]]:
        """(layer, site) -> {module: padded rank} for every allocated table."""
        return {(i, site): dict(t.ranks) for i, tables in enumerate(self._tables) for site, t in tables.items()}

    def clear(self) -> None:
        """Drop every table (e.g. when the engine goes idle); the next batch rebuilds what it needs."""
        self._capacity = 0
        self._tables = [{} for _ in range(self.num_layers)]
        self._owners = [[] for _ in range(self.num_layers)]

    # --- used by AdapterBatch ------------------------------------------------------------------------------

    def _reserve(self, slots: int) -> None:
        """Grow every table to at least ``slots`` rows (new rows are zeros)."""
        if slots <= self._capacity:
            return
        grow = slots - self._capacity
        for layer, tables in enumerate(self._tables):
            for table in tables.values():
                table.at = torch.cat((table.at, table.at.new_zeros(grow, *table.at.shape[1:])))
                for name, bt in table.bt.items():
                    table.bt[name] = torch.cat((bt, bt.new_zeros(grow, *bt.shape[1:])))
            self._owners[layer].extend([None] * grow)
        self._capacity = slots

    def _sync(self, layer: int, rows: Sequence[LoraLayer | None], slot_start: int) -> None:
        """Make slots ``slot_start + i`` hold ``rows[i]``'s weights of ``layer``, rewriting only what changed."""
        self._reserve(slot_start + len(rows))
        tables = self._tables[layer]
        for site in SITES:
            self._fit_layout(layer, site, tables, rows)
        owners = self._owners[layer]
        for i, lora in enumerate(rows):
            slot = slot_start + i
            owner = owners[slot]
            if lora is None:
                if owner is None:
                    continue
            elif isinstance(owner, weakref.ReferenceType) and owner() is lora:
                continue
            self._write(tables, slot, lora)
            owners[slot] = None if lora is None else weakref.ref(lora)
            self.stats.slot_writes += 1

    def _fit_layout(
        self, layer: int, site: str, tables: dict[str, _SiteTable], rows: Sequence[LoraLayer | None]
    ) -> None:
        """(Re)allocate the site's table when the rows need a module or a rank it lacks, or use far less."""
        need: dict[str, int] = {}
        for lora in rows:
            if lora is None:
                continue
            for name in SITES[site]:  # type: ignore[index]
                module = lora.modules.get(name)
                if module is not None:
                    need[name] = max(need.get(name, 0), module.rank)
        table = tables.get(site)
        if table is None:
            if need:
                tables[site] = self._alloc(need)
                self._mark_dirty(layer)
            return
        if any(r > table.ranks.get(name, 0) for name, r in need.items()):  # grow, keeping what it had
            tables[site] = self._alloc({name: max(r, table.ranks.get(name, 0)) for name, r in need.items()})
            self._mark_dirty(layer)
        elif table.width > 2 * sum(need.values()):  # hysteresis: shrink only when over twice what rows need
            if need:
                tables[site] = self._alloc(need)
            else:
                del tables[site]
            self._mark_dirty(layer)

    def _mark_dirty(self, layer: int) -> None:
        """A table of ``layer`` was reallocated: slots holding an adapter must be rewritten (zero slots stay)."""
        self.stats.relayouts += 1
        owners = self._owners[layer]
        for slot, owner in enumerate(owners):
            if owner is not None:
                owners[slot] = _DIRTY

    def _alloc(self, need: Mapping[str, int]) -> _SiteTable:
        modules = [m for m in MODULES if m in need]  # fused column order
        ranks = {m: need[m] for m in modules}
        offsets: dict[str, int] = {}
        width = 0
        for m in modules:
            offsets[m] = width
            width += ranks[m]
        in_features = self.modules[modules[0]].in_features
        dt, dev, cap = self.compute_dtype, self.device, self._capacity
        at = torch.zeros(cap, in_features, width, dtype=dt, device=dev)
        bt = {m: torch.zeros(cap, ranks[m], self.modules[m].out_features, dtype=dt, device=dev) for m in modules}
        return _SiteTable(ranks=ranks, offsets=offsets, at=at, bt=bt)

    def _write(self, tables: dict[str, _SiteTable], slot: int, lora: LoraLayer | None) -> None:
        """Copy one adapter layer (or zeros) into row ``slot`` of every table of the layer."""
        for table in tables.values():
            at = table.at[slot]  # [in, R]
            for name, width in table.ranks.items():
                off = table.offsets[name]
                bt = table.bt[name][slot]  # [r_m, out_m]
                module = None if lora is None else lora.modules.get(name)
                if module is None:
                    at[:, off : off + width].zero_()
                    bt.zero_()
                    continue
                r = module.rank
                spec = self.modules[name]
                if module.a.shape != (r, spec.in_features) or module.b.shape != (spec.out_features, r):
                    raise InvalidAdapter(
                        f"{name}: lora_A {tuple(module.a.shape)} / lora_B {tuple(module.b.shape)} do not fit the "
                        f"base layer ({spec.out_features} x {spec.in_features})"
                    )
                at[:, off : off + r].copy_(module.a.t())  # [in, r] <- [r, in]^T
                bt[:r].copy_(module.b.t())  # [r, out] <- [out, r]^T
                if r < width:
                    at[:, off + r : off + width].zero_()
                    bt[r:].zero_()


class AdapterBatch:
    """Built once per forward pass from the rows' adapters; every projection of every layer reads it."""

    def __init__(
        self,
        slots: LoraSlots,
        slot_start: int,
        row_layers: Callable[[int], list[LoraLayer | None]],
        span: tuple[int, int],
        rows: int,
    ) -> None:
        self.slots = slots
        self.slot_start = slot_start
        self.rows = rows
        self.span = span  # [lo, hi): batch rows from the first to the last row with an adapter
        self._row_layers = row_layers
        self._synced = [False] * slots.num_layers

    @classmethod
    def build(
        cls,
        row_adapters: Sequence[str | None],
        layer_lookup: LayerLookup,
        slots: LoraSlots,
        *,
        slot_start: int = 0,
        rows_per_item: int | Sequence[int] = 1,
    ) -> AdapterBatch | None:
        """The batch for rows ``[slot_start, slot_start + B)`` of the KV cache, or ``None`` if no row has an adapter.

        ``row_adapters[i]`` is item ``i``'s adapter id (``None``: the base model); item ``i`` spans
        ``rows_per_item`` consecutive batch rows (an int for all, or one count per item), so ``B`` is their sum.
        ``layer_lookup(adapter_id, layer)`` returns that adapter's ``LoraLayer`` for ``layer`` on the slots' device
        (``None`` if the adapter leaves the layer alone); it is called once per distinct adapter and layer, the
        first time the forward pass reaches the layer.
        """
        counts = [rows_per_item] * len(row_adapters) if isinstance(rows_per_item, int) else list(rows_per_item)
        if len(counts) != len(row_adapters) or any(c < 0 for c in counts):
            raise ValueError(f"rows_per_item {rows_per_item!r} does not fit {len(row_adapters)} items")
        per_row: list[str | None] = [a for a, c in zip(row_adapters, counts, strict=True) for _ in range(c)]
        used = [i for i, a in enumerate(per_row) if a is not None]
        if not used:
            return None
        if slot_start < 0:
            raise ValueError(f"slot_start must be >= 0, got {slot_start}")
        lo, hi = used[0], used[-1] + 1
        span_ids = per_row[lo:hi]
        distinct = list(dict.fromkeys(a for a in span_ids if a is not None))

        def row_layers(layer: int) -> list[LoraLayer | None]:
            found = {a: layer_lookup(a, layer) for a in distinct}
            return [None if a is None else found[a] for a in span_ids]

        return cls(slots, slot_start, row_layers, (lo, hi), len(per_row))

    def _table(self, layer: int, site: str) -> _SiteTable | None:
        """The site's table, after bringing the layer's slots up to date on the first visit of this pass."""
        if not self._synced[layer]:
            self.slots._sync(layer, self._row_layers(layer), self.slot_start + self.span[0])
            self._synced[layer] = True
        return self.slots._tables[layer].get(site)

    def add_delta(self, out: Tensor, x: Tensor, layer: int, name: ProjName) -> Tensor:
        """Add the rows' LoRA deltas for projection ``name`` of ``layer`` to ``out`` in place; return ``out``.

        x [B, T, in]; out [B, T, out_fused] in the fused column order (q|k|v, gate|up).
        """
        table = self._table(layer, name)
        if table is None:
            return out
        if x.shape[0] != self.rows:
            raise ValueError(f"batch has {x.shape[0]} rows, the adapter batch was built for {self.rows}")
        lo, hi = self.span
        first = self.slot_start + lo
        last = self.slot_start + hi
        xs = x[lo:hi].to(self.slots.compute_dtype)  # [b, T, in]
        h = torch.bmm(xs, table.at[first:last])  # [b, T, R]
        for module, width in table.ranks.items():
            off = table.offsets[module]
            c0, c1 = self.slots.modules[module].cols
            d = torch.bmm(h[..., off : off + width], table.bt[module][first:last])  # [b, T, out_m]
            out[lo:hi, :, c0:c1] += d  # type promotion casts back to the model dtype in place
        return out

    def delta(self, layer: int, site: ProjName, x: Tensor) -> Tensor | None:
        """The delta ``[B, T, out_fused]`` to add to projection ``site`` of ``layer``, or ``None`` if it has none.

        Zeros in the columns of modules no row's adapter targets. Allocates; the model uses ``add_delta``.
        """
        if self._table(layer, site) is None:
            return None
        width = self.slots.modules[SITES[site][-1]].cols[1]
        out = x.new_zeros(*x.shape[:-1], width)
        return self.add_delta(out, x, layer, site)


def _module_layout(cfg: ModelConfig) -> dict[str, _Module]:
    """Each PEFT module's input size and output columns within its fused projection."""
    fused = cfg.fused_rows()
    hidden, inter, attn = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    layout: dict[str, _Module] = {}
    for part in fused["wqkv"]:
        layout[part.hf_name] = _Module(part.hf_name, (part.start, part.stop), hidden, part.stop - part.start)
    layout["o_proj"] = _Module("o_proj", (0, hidden), attn, hidden)
    for part in fused["w13"]:
        layout[part.hf_name] = _Module(part.hf_name, (part.start, part.stop), hidden, part.stop - part.start)
    layout["down_proj"] = _Module("down_proj", (0, hidden), inter, hidden)
    return layout
