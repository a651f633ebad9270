"""The batched LoRA math: one engine step's rows, each with its own adapter (or none), through one forward pass.

Public API::

    SITES: dict[ProjName, tuple[str, ...]]         fused projection -> the PEFT modules whose outputs it holds
    module_layout(cfg) -> {module: ModuleSpec(name, cols, in_features, out_features)}
    LoraTables(cfg, *, device, dtype)              LoRA weights laid out for the math, kept across engine steps
        .nbytes, .layouts(), .stats, .clear()
    AdapterBatch.build(row_adapters, layer_lookup, tables, *, slot_start=0, rows_per_item=1, mode="auto")
        -> AdapterBatch | None
    AdapterBatch.add_delta(out, x, layer, name) -> out        (the model's ``AdapterHook``)
    AdapterBatch.delta(layer, site, x) -> Tensor | None

A batch with no adapter row has no ``AdapterBatch`` (``build`` returns ``None``) and pays nothing. Otherwise only
rows ``[lo, hi)``, from the first to the last row with an adapter, are touched; a base-only row inside that span
meets zero weights (per-slot) or no weights at all (shared), so its output is unchanged bit for bit. Each
(layer, site) is computed one of two ways, chosen per batch from the number ``N`` of distinct adapters among the
``b`` rows of the span:

- **per-slot** (``4 * N > b``, e.g. 32 rows with 32 adapters): every KV slot owns a row of a table laid out for
  ``torch.bmm``: ``at[s]`` = the slot's adapter's ``A^T`` for every module of the site side by side ``[in, R]``
  and per module ``bt[m][s]`` = its scaled ``B^T`` ``[r_m, out_m]``, ranks zero-padded to the widest adapter in
  use, absent modules zero. Then ``h = x @ at`` ``[b, T, R]`` and ``out[..., cols_m] += h[..., seg_m] @ bt[m]``:
  one bmm plus one bmm and one add per module, whatever the mix of ranks and target subsets. The table survives
  across steps and only slots whose adapter (``LoraLayer`` object) changed are rewritten: the engine keeps rows
  compacted in slots, so a retiring request changes one slot and an admitted one fills one.
- **shared** (``N == 1`` or ``4 * N <= b``, many rows per adapter): per distinct adapter, its modules' ``A``
  stacked along the rank axis ``[R, in]`` and per module its ``B`` ``[out_m, r_m]``, kept while the set of
  adapters at the layer is unchanged. For each adapter, only its own rows are gathered (``index_select``; no
  gather when it serves the whole span): ``h = x_a @ A^T``, ``d_m = h[..., seg_m] @ B_m^T`` and ``d_m`` is
  scattered back into its rows' columns (``index_add_``). Reads each adapter's weights once per step where
  per-slot reads one copy per row.

Row isolation is structural in both: a row's input meets only its own adapter's weights (per-slot: its own table
row in a ``bmm``; shared: its own group), so no value of one row (a NaN, an inf) can reach another row's output;
nothing relies on multiplying other rows' deltas by zero.

Which layout wins at which ``N`` is measured by ``bench/adapters_math.py --compare`` (figures in
``bench/README.md``); the shared form costs one gather and one scatter per adapter and site, and none when a
single adapter serves the whole span (the common case).

On CPU the tables and the small matmuls are fp32 even when the model runs in bf16/fp16: CPU bmm in bf16 is
several times slower than fp32 at LoRA shapes, and the weights are small. On CUDA the tables use the model dtype.
The tables hold weak references to the ``LoraLayer`` objects they copied, so they never keep evicted adapter
weights alive and notice when the store hands out a new object (reload, another adapter in a slot).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from service.adapters.types import MODULES, LoraLayer, LoraModule
from service.errors import InvalidAdapter
from service.model.config import ModelConfig
from service.model.llama import ProjName

SITES: Final[dict[ProjName, tuple[str, ...]]] = {
    "wqkv": ("q_proj", "k_proj", "v_proj"),
    "wo": ("o_proj",),
    "w13": ("gate_proj", "up_proj"),
    "w2": ("down_proj",),
}
# Shared mode while each distinct adapter has at least this many rows (measured crossover: ~4 at 32 rows).
SHARED_MIN_ROWS_PER_ADAPTER: Final = 4
SHARED_SETS_KEPT: Final = 2  # adapter sets whose shared tables are kept per layer

LayerLookup = Callable[[str, int], LoraLayer | None]
Mode = Literal["auto", "slots", "shared"]


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


class _Dirty:
    """Marks a slot whose table rows hold unknown contents (after a relayout): any use rewrites it."""


_DIRTY: Final = _Dirty()
_Owner = weakref.ReferenceType[LoraLayer] | _Dirty | None  # None: the slot's rows are zeros
_SetKey = tuple[weakref.ReferenceType[LoraLayer] | None, ...]  # the adapters' layers a shared table was built from


@dataclass
class _SlotTable:
    """Per-slot (layer, site) table: ``at`` [S, in, R] and per module ``bt`` [S, r_m, out_m], R = sum of r_m."""

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
class _GroupTable:
    """One adapter's weights of one (layer, site) for the shared math: ``a`` [R, in] (its modules' A stacked
    along the rank axis) and per module (module, start, stop of its columns of ``h``, B [out_m, r_m])."""

    a: Tensor
    segs: list[tuple[str, int, int, Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, *(s[3] for s in self.segs)))


@dataclass
class _SharedTable:
    """Shared (layer, site) table of N distinct adapters: one ``_GroupTable`` each (None: it skips the site)."""

    groups: list[_GroupTable | None]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups if g is not None)


@dataclass
class TableStats:
    """Counters for tests and benchmarks: how much copying the steps caused."""

    slot_writes: int = 0  # (layer, slot) pairs rewritten because their adapter changed
    relayouts: int = 0  # per-slot (layer, site) tables reallocated: the set of modules or ranks changed
    shared_builds: int = 0  # layers whose shared tables were rebuilt: the set of adapters changed


class LoraTables:
    """LoRA weights laid out for the batched math, owned by the engine and reused by every step's batch."""

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        half = dtype in (torch.bfloat16, torch.float16)
        self.compute_dtype = torch.float32 if self.device.type == "cpu" and half else dtype
        self.modules = module_layout(cfg)
        self.stats = TableStats()
        self.clear()

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def nbytes(self) -> int:
        """Bytes held by all tables."""
        per_slot = sum(t.nbytes for tables in self._slot for t in tables.values())
        shared = sum(t.nbytes for sets in self._shared for _, tables in sets for t in tables.values())
        return per_slot + shared

    def layouts(self) -> dict[tuple[int, str], dict[str, int]]:
        """(layer, site) -> {module: padded rank} of every per-slot table."""
        return {(i, site): dict(t.ranks) for i, tables in enumerate(self._slot) for site, t in tables.items()}

    def clear(self) -> None:
        """Drop every table (e.g. when the engine goes idle); the next batch rebuilds what it needs."""
        self._capacity = 0
        self._slot: list[dict[str, _SlotTable]] = [{} for _ in range(self.num_layers)]
        self._owners: list[list[_Owner]] = [[] for _ in range(self.num_layers)]
        # Per layer, the shared tables of the last few adapter sets, most recent first: an engine step's prefill
        # (newcomers' adapters) and decode (everyone's) alternate between two sets without rebuilding either.
        self._shared: list[list[tuple[_SetKey, dict[str, _SharedTable]]]] = [[] for _ in range(self.num_layers)]

    # --- shared tables -------------------------------------------------------------------------------------

    def _sync_shared(self, layer: int, distinct: Sequence[LoraLayer | None]) -> dict[str, _SharedTable]:
        """The layer's shared tables for ``distinct`` (in that order): kept from a recent step, or built now."""
        sets = self._shared[layer]
        for i, (key, kept) in enumerate(sets):
            if _same_layers(key, distinct):
                sets.insert(0, sets.pop(i))
                return kept
        tables: dict[str, _SharedTable] = {}
        dt = self.compute_dtype
        for site, names in SITES.items():
            groups: list[_GroupTable | None] = []
            for lora in distinct:
                a_parts: list[Tensor] = []
                segs: list[tuple[str, int, int, Tensor]] = []
                width = 0
                for name in names:
                    module = None if lora is None else lora.modules.get(name)
                    if module is not None:
                        self._check(name, module)
                        a_parts.append(module.a)
                        segs.append((name, width, width + module.rank, module.b.to(dt)))  # B [out_m, r_m]
                        width += module.rank
                groups.append(_GroupTable(torch.cat(a_parts).to(dt), segs) if a_parts else None)  # A [R, in]
            if any(g is not None for g in groups):
                tables[site] = _SharedTable(groups)
        sets.insert(0, (tuple(None if lora is None else weakref.ref(lora) for lora in distinct), tables))
        del sets[SHARED_SETS_KEPT:]
        self.stats.shared_builds += 1
        return tables

    # --- per-slot tables -----------------------------------------------------------------------------------

    def _sync_slots(self, layer: int, rows: Sequence[LoraLayer | None], slot_start: int) -> None:
        """Make slots ``slot_start + i`` hold ``rows[i]``'s weights of ``layer``, rewriting only what changed."""
        self._reserve(slot_start + len(rows))
        tables = self._slot[layer]
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

    def _reserve(self, slots: int) -> None:
        """Grow every per-slot table to at least ``slots`` rows (new rows are zeros)."""
        if slots <= self._capacity:
            return
        grow = slots - self._capacity
        for layer, tables in enumerate(self._slot):
            for table in tables.values():
                table.at = torch.cat((table.at, table.at.new_zeros(grow, *table.at.shape[1:])))
                for name, bt in table.bt.items():
                    table.bt[name] = torch.cat((bt, bt.new_zeros(grow, *bt.shape[1:])))
            self._owners[layer].extend([None] * grow)
        self._capacity = slots

    def _fit_layout(
        self, layer: int, site: str, tables: dict[str, _SlotTable], rows: Sequence[LoraLayer | None]
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
        elif any(r > table.ranks.get(name, 0) for name, r in need.items()):  # grow, keeping what it had
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

    def _alloc(self, need: Mapping[str, int]) -> _SlotTable:
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
        return _SlotTable(ranks=ranks, offsets=offsets, at=at, bt=bt)

    def _write(self, tables: dict[str, _SlotTable], slot: int, lora: LoraLayer | None) -> None:
        """Copy one adapter layer (or zeros) into row ``slot`` of every per-slot table of the layer."""
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
                self._check(name, module)
                r = module.rank
                at[:, off : off + r].copy_(module.a.t())  # [in, r] <- [r, in]^T
                bt[:r].copy_(module.b.t())  # [r, out] <- [out, r]^T
                if r < width:
                    at[:, off + r : off + width].zero_()
                    bt[r:].zero_()

    def _check(self, name: str, module: LoraModule) -> None:
        spec = self.modules[name]
        r = module.rank
        if module.a.shape != (r, spec.in_features) or module.b.shape != (spec.out_features, r):
            raise InvalidAdapter(
                f"{name}: lora_A {tuple(module.a.shape)} / lora_B {tuple(module.b.shape)} do not fit the "
                f"base layer ({spec.out_features} x {spec.in_features})"
            )


def _same_layers(key: _SetKey, layers: Sequence[LoraLayer | None]) -> bool:
    """Whether ``key`` holds weak references to exactly ``layers`` (the same objects, in order)."""
    if len(key) != len(layers):
        return False
    return all(
        (ref is None) if lora is None else (ref is not None and ref() is lora)
        for ref, lora in zip(key, layers, strict=True)
    )


class AdapterBatch:
    """Built once per forward pass from the rows' adapters; every projection of every layer reads it."""

    def __init__(
        self,
        tables: LoraTables,
        lookup: LayerLookup,
        span_ids: list[str | None],
        *,
        lo: int,
        rows: int,
        slot_start: int,
        mode: Mode,
    ) -> None:
        self.tables = tables
        self.rows = rows  # B: the batch rows the model will pass
        self.span = (lo, lo + len(span_ids))  # [lo, hi): first to last row with an adapter
        self.slot_start = slot_start
        self._lookup = lookup
        self._span_ids = span_ids
        self._distinct = sorted({a for a in span_ids if a is not None})
        n = len(self._distinct)
        auto = n == 1 or n * SHARED_MIN_ROWS_PER_ADAPTER <= len(span_ids)
        self.shared = mode == "shared" or (mode == "auto" and auto)
        # Shared math: per distinct adapter, the span rows it serves ([n_i] int64), None when it serves them all.
        self._group_rows: list[Tensor | None] = []
        if self.shared:
            for a in self._distinct:
                mine = [i for i, row in enumerate(span_ids) if row == a]
                whole = len(mine) == len(span_ids)
                self._group_rows.append(None if whole else torch.tensor(mine, device=tables.device))
        self._synced = [False] * tables.num_layers
        self._shared_of: list[dict[str, _SharedTable]] = [{} for _ in range(tables.num_layers)]

    @classmethod
    def build(
        cls,
        row_adapters: Sequence[str | None],
        layer_lookup: LayerLookup,
        tables: LoraTables,
        *,
        slot_start: int = 0,
        rows_per_item: int | Sequence[int] = 1,
        mode: Mode = "auto",
    ) -> AdapterBatch | None:
        """The batch for rows ``[slot_start, slot_start + B)`` of the KV cache, or ``None`` if no row has an adapter.

        ``row_adapters[i]`` is item ``i``'s adapter id (``None``: the base model); item ``i`` spans
        ``rows_per_item`` consecutive batch rows (an int for all, or one count per item), so ``B`` is their sum.
        ``layer_lookup(adapter_id, layer)`` returns that adapter's ``LoraLayer`` for ``layer`` on the tables'
        device (``None`` if the adapter leaves the layer alone); it is called once per distinct adapter and layer,
        the first time the forward pass reaches the layer. ``mode`` forces the per-slot or shared layout
        (tests, benchmarks); ``"auto"`` picks by the number of rows per distinct adapter.
        """
        counts = [rows_per_item] * len(row_adapters) if isinstance(rows_per_item, int) else list(rows_per_item)
        if len(counts) != len(row_adapters) or any(c < 0 for c in counts):
            raise ValueError(f"rows_per_item {rows_per_item!r} does not fit {len(row_adapters)} items")
        if slot_start < 0:
            raise ValueError(f"slot_start must be >= 0, got {slot_start}")
        per_row = [a for a, c in zip(row_adapters, counts, strict=True) for _ in range(c)]
        used = [i for i, a in enumerate(per_row) if a is not None]
        if not used:
            return None
        lo, hi = used[0], used[-1] + 1
        span = per_row[lo:hi]
        return cls(tables, layer_lookup, span, lo=lo, rows=len(per_row), slot_start=slot_start, mode=mode)

    def _sync(self, layer: int) -> None:
        """Bring the layer's tables up to date on the first visit of this forward pass."""
        found = {a: self._lookup(a, layer) for a in self._distinct}
        if self.shared:
            self._shared_of[layer] = self.tables._sync_shared(layer, [found[a] for a in self._distinct])
        else:
            rows = [None if a is None else found[a] for a in self._span_ids]
            self.tables._sync_slots(layer, rows, self.slot_start + self.span[0])
        self._synced[layer] = True

    def add_delta(self, out: Tensor, x: Tensor, layer: int, name: ProjName) -> Tensor:
        """Add the rows' LoRA deltas for projection ``name`` of ``layer`` to ``out`` in place; return ``out``.

        x [B, T, in]; out [B, T, out_fused] in the fused column order (q|k|v, gate|up).
        """
        if not self._synced[layer]:
            self._sync(layer)
        if x.shape[0] != self.rows:
            raise ValueError(f"batch has {x.shape[0]} rows, the adapter batch was built for {self.rows}")
        lo, hi = self.span
        if self.shared:
            shared = self._shared_of[layer].get(name)
            if shared is not None:
                self._add_shared(out[lo:hi], x[lo:hi], shared)
            return out
        table = self.tables._slot[layer].get(name)
        if table is not None:
            self._add_slots(out[lo:hi], x[lo:hi], table)
        return out

    def _add_slots(self, out: Tensor, x: Tensor, table: _SlotTable) -> None:
        # x [b, T, in], out [b, T, out_fused]: views of the span's rows
        first = self.slot_start + self.span[0]
        slots = slice(first, first + x.shape[0])
        h = torch.bmm(x.to(self.tables.compute_dtype), table.at[slots])  # [b, T, R]
        for module, width in table.ranks.items():
            off = table.offsets[module]
            c0, c1 = self.tables.modules[module].cols
            d = torch.bmm(h[..., off : off + width], table.bt[module][slots])  # [b, T, out_m]
            out[..., c0:c1] += d  # type promotion casts back to the model dtype in place

    def _add_shared(self, out: Tensor, x: Tensor, table: _SharedTable) -> None:
        # x [b, T, in], out [b, T, out_fused]: views of the span's rows. Each adapter's rows only: a row's values
        # never meet another adapter's weights (no masking by zero, where 0 * NaN would leak across rows).
        xc = x.to(self.tables.compute_dtype)
        for group, rows in zip(table.groups, self._group_rows, strict=True):
            if group is None:
                continue
            xg = xc if rows is None else xc.index_select(0, rows)  # [n, T, in]
            h = F.linear(xg, group.a)  # [n, T, R]
            for module, start, stop, b in group.segs:
                c0, c1 = self.tables.modules[module].cols
                d = F.linear(h[..., start:stop], b)  # [n, T, out_m]
                if rows is None:
                    out[..., c0:c1] += d  # type promotion casts back to the model dtype in place
                else:
                    out[..., c0:c1].index_add_(0, rows, d.to(out.dtype))

    def delta(self, layer: int, site: ProjName, x: Tensor) -> Tensor | None:
        """The delta ``[B, T, out_fused]`` to add to projection ``site`` of ``layer``, or ``None`` if it has none.

        Zeros in the columns of modules no row's adapter targets. Allocates; the model uses ``add_delta``.
        """
        if not self._synced[layer]:
            self._sync(layer)
        source = self._shared_of[layer] if self.shared else self.tables._slot[layer]
        if site not in source:
            return None
        width = self.tables.modules[SITES[site][-1]].cols[1]
        out = x.new_zeros(*x.shape[:-1], width)
        return self.add_delta(out, x, layer, site)
