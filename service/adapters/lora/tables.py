"""LoRA weights laid out for the batched math (``LoraTables``), kept across engine steps.

Two layouts, one per way ``service.adapters.lora.AdapterBatch`` computes a (layer, site):

- **per-slot**: every KV slot owns a row of a table: ``a[s]`` = the slot's adapter's ``A`` for every module of the
  site along the rank axis ``[R, in]`` (stored ``[in, R]`` for eager ``bmm``) and per module ``bt[m][s]`` = its
  scaled ``B^T`` ``[r_m, out_m]``, ranks zero-padded to the widest adapter in use, absent modules zero. The table
  survives across steps and only slots whose adapter (``LoraLayer`` object) changed are rewritten: the engine keeps
  rows compacted in slots, so a retiring request changes one slot and an admitted one fills one. A table grows when
  the rows need a module or a rank it lacks, and shrinks only when it is over twice as wide as they need.
- **shared**: a set of adapters stacked along a leading axis for grouped ``bmm``: ``a`` ``[G, R, in]`` (each
  adapter's modules' ``A`` along the rank axis) and per module ``bt`` ``[G, r_m, out_m]``, ranks zero-padded to the
  widest in the set; kept for the last ``SHARED_SETS_KEPT`` sets. A batch whose adapters a kept set holds maps its
  rows into that set's groups (``shared_order``): rows retiring one by one at the end of a burst, or a prefill of
  some of the decoding rows' adapters, rebuild nothing. A new set takes in the previous batch's adapters too while
  that at most doubles it, so a burst admitted over a few steps builds growing sets once each, not every subset.

A per-row ``scale`` rides along per module where a DoRA row needs it (DoRA's per-channel factor on the base output
plus the delta, ones in the other rows), and a per-row ``bias`` where a row's adapter has a trained LoRA bias
(zeros in the other rows); a table without such rows has neither, and a plain LoRA batch pays nothing.

On CPU the eager math's tables are fp32 even when the model runs in bf16/fp16: CPU bmm in bf16 is several times
slower than fp32 at LoRA shapes. The compiled kernel (``native``, ``NativeKernels.lora_delta``) reads the tables of
the model's dtype, float32 or bfloat16 (widened by a shift, half the bytes a step reads), with float32 sums; a
float32 model's tables stay float32. On CUDA the tables use the model dtype. The tables hold weak
references to the ``LoraLayer`` objects they copied, so they never keep evicted adapter weights alive and notice
when the store hands out a new object (reload, another adapter in a slot). Every weight copied in is checked
against the base layer's shape (``InvalidAdapter`` otherwise).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Mapping, Sequence
from typing import Final

import torch

from service.adapters.lora.layouts import (
    SITES,
    Need,
    Refs,
    Segment,
    SharedTable,
    SlotTable,
    TableStats,
    module_layout,
    needs_of,
    refs_of,
    same_objects,
)
from service.adapters.lora.types import MODULES, LoraLayer, LoraModule
from service.errors import InvalidAdapter
from service.kernels import KERNEL_DTYPES
from service.kernels.lora import LoraSegment, LoraSite, StackLora, lora_site
from service.kernels.native import NativeKernels
from service.model.config import ModelConfig
from service.model.llama import ProjName

SHARED_SETS_KEPT: Final = 2  # adapter sets whose shared tables are kept per layer


class _Dirty:
    """Marks a slot whose table rows hold unknown contents (after a relayout): any use rewrites it."""


_DIRTY: Final = _Dirty()
_Owner = weakref.ReferenceType[LoraLayer] | _Dirty | None  # None: the slot's rows are zeros


class LoraTables:
    """LoRA weights laid out for the batched math, owned by the engine and reused by every step's batch.

    A batch brings a layer up to date with ``sync_slots`` (per-slot) or ``sync_shared`` (shared) on its first
    visit, then reads ``slot_tables[layer][site]`` or the shared tables ``sync_shared`` returned."""

    def __init__(
        self, cfg: ModelConfig, *, device: torch.device | str, dtype: torch.dtype, native: NativeKernels | None = None
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        # The compiled kernel the batches compute with (``NativeKernels.lora_delta``), or None: eager torch.
        self.native = native if self.device.type == "cpu" and dtype in KERNEL_DTYPES else None
        half = dtype in (torch.bfloat16, torch.float16)
        eager_cpu_half = self.device.type == "cpu" and half and self.native is None
        self.compute_dtype = torch.float32 if eager_cpu_half else dtype  # the tables' dtype
        self.modules = module_layout(cfg)
        self.stats = TableStats()
        # Counts every change to what a table holds or where (a slot written, a table grown or reallocated, a shared
        # set built, everything dropped): a compiled stack made at one count reads the same tables at that count.
        self.generation = 0
        self.clear()

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def nbytes(self) -> int:
        """Bytes held by all tables."""
        per_slot = sum(t.nbytes for tables in self.slot_tables for t in tables.values())
        shared = sum(t.nbytes for sets in self._shared for _, _, tables in sets for t in tables.values())
        return per_slot + shared

    def layouts(self) -> dict[tuple[int, str], dict[str, int]]:
        """(layer, site) -> {module: padded rank} of every per-slot table."""
        return {(i, site): dict(t.ranks) for i, tables in enumerate(self.slot_tables) for site, t in tables.items()}

    def clear(self) -> None:
        """Drop every table (e.g. when the engine goes idle); the next batch rebuilds what it needs."""
        self._capacity = 0
        self.generation += 1
        # The last batch's compiled stack (``AdapterBatch.stack_lora``): the generation and the batch's key, its
        # rows' owners (held so that their ids stay theirs) and the stack.
        self._kept_stack: tuple[tuple[int, Hashable], tuple[object, ...] | None, StackLora] | None = None
        self.slot_tables: list[dict[str, SlotTable]] = [{} for _ in range(self.num_layers)]  # [layer][site]
        self._owners: list[list[_Owner]] = [[] for _ in range(self.num_layers)]
        # The adapter keys of the last few shared sets, most recent first, and per layer their tables with the
        # layer objects they were built from: an engine step's prefill (newcomers' adapters) and decode (everyone's)
        # alternate between two sets without rebuilding either.
        self._orders: list[tuple[Hashable, ...]] = []
        self._last: tuple[Hashable, ...] = ()  # the adapters of the last shared batch
        self._shared: list[list[tuple[tuple[Hashable, ...], Refs, dict[str, SharedTable]]]] = [
            [] for _ in range(self.num_layers)
        ]

    # --- the compiled kernel's view ---------------------------------------------------------------------------

    def kernel_of(self, table: SharedTable | SlotTable) -> LoraSite:
        """``table`` as the compiled kernel reads it (A [G, R, in] and one segment per module), made on first use."""
        if table.kernel is None:

            def col(module: str) -> int:
                return self.modules[module].cols[0]

            if isinstance(table, SharedTable):
                segs = [LoraSegment(s.start, col(s.module), s.bt, s.scale, s.bias) for s in table.segs]
            else:
                segs = [
                    LoraSegment(table.offsets[m], col(m), table.bt[m], table.scale.get(m), table.bias.get(m))
                    for m in table.ranks
                ]
            table.kernel = lora_site(table.a, segs)
        return table.kernel

    def kept_stack(self, key: Hashable | None) -> StackLora | None:
        """The stack ``keep_stack`` kept for ``key`` if no table changed since (same generation), else None."""
        kept = self._kept_stack
        return kept[2] if key is not None and kept is not None and kept[0] == (self.generation, key) else None

    def keep_stack(self, key: Hashable | None, owners: tuple[object, ...] | None, stack: StackLora) -> None:
        """Keep a batch's compiled stack for the next batch of the same ``key`` (None: keep nothing)."""
        if key is not None:
            self._kept_stack = ((self.generation, key), owners, stack)

    # --- shared tables -------------------------------------------------------------------------------------

    def shared_order(self, keys: Sequence[Hashable]) -> tuple[Hashable, ...]:
        """The groups a shared batch of adapters ``keys`` maps its rows into: the most recent kept set that holds
        them all, else ``keys`` followed by the previous shared batch's other adapters while that at most doubles
        the set (a prefill's newcomers join the rows that decoded last: the next decode batch is their union), else
        ``keys``. The previous batch's own adapters, not its set's: a set never keeps adapters no row had lately.
        Groups without rows cost nothing in the compiled kernel; the eager math would compute them, so without the
        kernel it is always ``keys``."""
        if self.native is None:
            return tuple(keys)
        last, self._last = self._last, tuple(keys)
        if (i := self._holding(keys)) is not None:
            self._orders.insert(0, self._orders.pop(i))
            return self._orders[0]
        want = set(keys)
        extra = [k for k in last if k not in want]
        order = tuple(keys) + (tuple(extra) if len(extra) <= len(want) else ())
        self._orders.insert(0, order)
        del self._orders[SHARED_SETS_KEPT:]
        return order

    def holds(self, keys: Sequence[Hashable]) -> bool:
        """Whether a kept shared set holds every adapter of ``keys`` (with the compiled kernel): a batch of them
        takes the shared layout at no copy, however few rows each adapter has (rows retiring at a burst's end)."""
        return self.native is not None and self._holding(keys) is not None

    def _holding(self, keys: Sequence[Hashable]) -> int | None:
        want = set(keys)
        return next((i for i, order in enumerate(self._orders) if want <= set(order)), None)

    def sync_shared(
        self, layer: int, order: tuple[Hashable, ...], found: Mapping[Hashable, LoraLayer | None]
    ) -> dict[str, SharedTable]:
        """The layer's shared tables with one group per key of ``order`` (``shared_order``'s): kept from a recent
        step when its keys of ``found`` (the batch's adapters, their layer objects) are still the same objects, or
        built now. A key of ``order`` outside ``found`` keeps the object a kept set had for it, or zeros."""
        sets = self._shared[layer]
        at = {k: i for i, k in enumerate(order)}
        for i, (keys, refs, kept) in enumerate(sets):
            if keys == order and same_objects(tuple(refs[at[k]] for k in found), list(found.values())):
                sets.insert(0, sets.pop(i))
                return kept
        before: dict[Hashable, LoraLayer | None] = {}
        for keys, refs, _ in sets:
            for k, ref in zip(keys, refs, strict=True):
                before.setdefault(k, None if ref is None else ref())
        distinct = [found[k] if k in found else before.get(k) for k in order]
        tables: dict[str, SharedTable] = {}
        self.generation += 1
        for site in SITES:
            table = self._stack(site, distinct)
            if table is not None:
                tables[site] = table
        sets.insert(0, (order, refs_of(distinct), tables))
        del sets[SHARED_SETS_KEPT:]
        self.stats.shared_builds += 1
        return tables

    def _stack(self, site: ProjName, distinct: Sequence[LoraLayer | None]) -> SharedTable | None:
        """The site's weights of ``distinct`` stacked along a leading adapter axis; None if none targets it."""
        need = needs_of(site, distinct)
        if not need.ranks:
            return None
        g, width = len(distinct), sum(need.ranks.values())
        dt, dev = self.compute_dtype, self.device
        a = torch.zeros(g, width, self.modules[next(iter(need.ranks))].in_features, dtype=dt, device=dev)  # [G, R, in]
        segs: list[Segment] = []
        start = 0
        for name, r_max in need.ranks.items():
            out_m = self.modules[name].out_features
            seg = Segment(name, start, start + r_max, torch.zeros(g, r_max, out_m, dtype=dt, device=dev))
            if name in need.scaled:
                seg.scale = torch.ones(g, out_m, dtype=torch.float32, device=dev)
            if name in need.biased:
                seg.bias = torch.zeros(g, out_m, dtype=dt, device=dev)
            for i, lora in enumerate(distinct):
                module = None if lora is None else lora.modules.get(name)
                if module is not None:
                    self._check(name, module)
                    a[i, start : start + module.rank].copy_(module.a)  # [r, in]
                    seg.bt[i, : module.rank].copy_(module.b.t())  # [r, out] <- [out, r]^T
                    if seg.scale is not None and module.rescale is not None:
                        seg.scale[i].copy_(module.rescale)
                    if seg.bias is not None and module.bias is not None:
                        seg.bias[i].copy_(module.bias)
            segs.append(seg)
            start += r_max
        return SharedTable(a, segs)

    # --- per-slot tables -----------------------------------------------------------------------------------

    def sync_slots(self, layer: int, rows: Sequence[LoraLayer | None], slot_start: int) -> None:
        """Make slots ``slot_start + i`` hold ``rows[i]``'s weights of ``layer``, rewriting only what changed."""
        self._reserve(slot_start + len(rows))
        tables = self.slot_tables[layer]
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
        self.generation += 1
        for layer, tables in enumerate(self.slot_tables):
            for table in tables.values():
                table.kernel = None
                grown = self._slot_a(slots, *table.a.shape[1:])
                grown[: self._capacity].copy_(table.a)
                table.a = grown
                for name, bt in table.bt.items():
                    table.bt[name] = torch.cat((bt, bt.new_zeros(grow, *bt.shape[1:])))
                for name, sc in table.scale.items():
                    table.scale[name] = torch.cat((sc, sc.new_ones(grow, sc.shape[1])))
                for name, bias in table.bias.items():
                    table.bias[name] = torch.cat((bias, bias.new_zeros(grow, bias.shape[1])))
            self._owners[layer].extend([None] * grow)
        self._capacity = slots

    def _fit_layout(
        self, layer: int, site: str, tables: dict[str, SlotTable], rows: Sequence[LoraLayer | None]
    ) -> None:
        """(Re)allocate the site's table when the rows need a module, a rank or an extra it lacks, or use far less."""
        need = needs_of(site, rows)
        table = tables.get(site)
        if table is None:
            if need.ranks:
                tables[site] = self._alloc(need)
                self._mark_dirty(layer)
        elif not need.covered_by(table.need):  # grow, keeping what it had
            tables[site] = self._alloc(need.grown(table.need))
            self._mark_dirty(layer)
        elif table.width > 2 * sum(need.ranks.values()):  # hysteresis: shrink only when over twice what rows need
            if need.ranks:
                tables[site] = self._alloc(need)
            else:
                del tables[site]
            self._mark_dirty(layer)

    def _mark_dirty(self, layer: int) -> None:
        """A table of ``layer`` was reallocated: slots holding an adapter must be rewritten (zero slots stay)."""
        self.stats.relayouts += 1
        self.generation += 1
        owners = self._owners[layer]
        for slot, owner in enumerate(owners):
            if owner is not None:
                owners[slot] = _DIRTY

    def _alloc(self, need: Need) -> SlotTable:
        modules = [m for m in MODULES if m in need.ranks]  # fused column order
        ranks = {m: need.ranks[m] for m in modules}
        offsets: dict[str, int] = {}
        width = 0
        for m in modules:
            offsets[m] = width
            width += ranks[m]
        in_features = self.modules[modules[0]].in_features
        dt, dev, cap = self.compute_dtype, self.device, self._capacity
        a = self._slot_a(cap, width, in_features)
        bt = {m: torch.zeros(cap, ranks[m], self.modules[m].out_features, dtype=dt, device=dev) for m in modules}
        scale = {m: torch.ones(cap, self.modules[m].out_features, dtype=torch.float32, device=dev) for m in need.scaled}
        bias = {m: torch.zeros(cap, self.modules[m].out_features, dtype=dt, device=dev) for m in need.biased}
        return SlotTable(ranks=ranks, offsets=offsets, a=a, bt=bt, scale=scale, bias=bias)

    def _slot_a(self, slots: int, width: int, in_features: int) -> torch.Tensor:
        """Zeros [slots, R, in] for a per-slot ``a``, stored as its reader wants it: rows contiguous for the
        compiled kernel, [slots, in, R] (this is its transposed view) for eager ``bmm``, 1.5x faster so on CPU."""
        dt, dev = self.compute_dtype, self.device
        if self.native is not None:
            return torch.zeros(slots, width, in_features, dtype=dt, device=dev)
        return torch.zeros(slots, in_features, width, dtype=dt, device=dev).transpose(1, 2)

    def _write(self, tables: dict[str, SlotTable], slot: int, lora: LoraLayer | None) -> None:
        """Copy one adapter layer (or zeros) into row ``slot`` of every per-slot table of the layer."""
        self.generation += 1
        for table in tables.values():
            a = table.a[slot]  # [R, in]
            for name, width in table.ranks.items():
                off = table.offsets[name]
                bt = table.bt[name][slot]  # [r_m, out_m]
                module = None if lora is None else lora.modules.get(name)
                _write_extras(table, name, slot, module)
                if module is None:
                    a[off : off + width].zero_()
                    bt.zero_()
                    continue
                self._check(name, module)
                r = module.rank
                a[off : off + r].copy_(module.a)  # [r, in]
                bt[:r].copy_(module.b.t())  # [r, out] <- [out, r]^T
                if r < width:
                    a[off + r : off + width].zero_()
                    bt[r:].zero_()

    def _check(self, name: str, module: LoraModule) -> None:
        spec = self.modules[name]
        r = module.rank
        if module.a.shape != (r, spec.in_features) or module.b.shape != (spec.out_features, r):
            raise InvalidAdapter(
                f"{name}: lora_A {tuple(module.a.shape)} / lora_B {tuple(module.b.shape)} do not fit the "
                f"base layer ({spec.out_features} x {spec.in_features})"
            )


def _write_extras(table: SlotTable, name: str, slot: int, module: LoraModule | None) -> None:
    """Row ``slot``'s DoRA scale (ones without one) and trained bias (zeros without one) of ``name``, where the
    table has them."""
    scale = table.scale.get(name)
    if scale is not None:
        rescale = None if module is None else module.rescale
        if rescale is None:
            scale[slot].fill_(1.0)
        else:
            scale[slot].copy_(rescale)
    bias = table.bias.get(name)
    if bias is not None:
        value = None if module is None else module.bias
        if value is None:
            bias[slot].zero_()
        else:
            bias[slot].copy_(value)


__all__ = ["SHARED_SETS_KEPT", "LoraTables"]
