"""The batched LoRA math: one engine step's rows, each with its own adapter (or none), through one forward pass.

``AdapterBatch.build`` makes the batch of one forward pass (``None`` when no row has an adapter: such a batch pays
nothing); the model calls ``add_delta`` (its ``AdapterHook``) on every projection. Only rows ``[lo, hi)``, from
the first to the last row with an adapter, are touched; a base-only row inside that span meets zero weights
(per-slot) or no weights at all (shared), so its output is unchanged bit for bit. Each (layer, site) is computed
one of two ways over the tables of ``service.adapters.lora_tables``, chosen per batch from the number ``N`` of
distinct adapters among the ``b`` rows of the span:

- **per-slot** (``4 * N > b``, e.g. 32 rows with 32 adapters): ``h = x @ at`` ``[b, T, R]`` and
  ``out[..., cols_m] += h[..., seg_m] @ bt[m]``: one bmm plus one bmm and one add per module, whatever the mix of
  ranks and target subsets.
- **shared** (``N == 1`` or ``4 * N <= b``, many rows per adapter): for each adapter, only its own rows are
  gathered (``index_select``; no gather when it serves the whole span): ``h = x_a @ A^T``,
  ``d_m = h[..., seg_m] @ B_m^T`` and ``d_m`` is scattered back into its rows' columns (``index_add_``). Reads each
  adapter's weights once per step where per-slot reads one copy per row.

Row isolation is structural in both: a row's input meets only its own adapter's weights (per-slot: its own table
row in a ``bmm``; shared: its own group), so no value of one row (a NaN, an inf) can reach another row's output;
nothing relies on multiplying other rows' deltas by zero.

Which layout wins at which ``N`` is measured by ``bench/adapters_math.py --compare`` (figures in
``bench/README.md``); the shared form costs one gather and one scatter per adapter and site, and none when a
single adapter serves the whole span (the common case).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from service.adapters.lora_tables import SITES, LoraTables, ModuleSpec, SharedTable, SlotTable, module_layout
from service.adapters.types import LoraLayer
from service.model.llama import ProjName

# Shared mode while each distinct adapter has at least this many rows (measured crossover: ~4 at 32 rows).
SHARED_MIN_ROWS_PER_ADAPTER: Final = 4

LayerLookup = Callable[[str, int], LoraLayer | None]
Mode = Literal["auto", "slots", "shared"]


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
        self._shared_of: list[dict[str, SharedTable]] = [{} for _ in range(tables.num_layers)]

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
            self._shared_of[layer] = self.tables.sync_shared(layer, [found[a] for a in self._distinct])
        else:
            rows = [None if a is None else found[a] for a in self._span_ids]
            self.tables.sync_slots(layer, rows, self.slot_start + self.span[0])
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
        table = self.tables.slot_tables[layer].get(name)
        if table is not None:
            self._add_slots(out[lo:hi], x[lo:hi], table)
        return out

    def _add_slots(self, out: Tensor, x: Tensor, table: SlotTable) -> None:
        # x [b, T, in], out [b, T, out_fused]: views of the span's rows
        first = self.slot_start + self.span[0]
        slots = slice(first, first + x.shape[0])
        h = torch.bmm(x.to(self.tables.compute_dtype), table.at[slots])  # [b, T, R]
        for module, width in table.ranks.items():
            off = table.offsets[module]
            c0, c1 = self.tables.modules[module].cols
            d = torch.bmm(h[..., off : off + width], table.bt[module][slots])  # [b, T, out_m]
            out[..., c0:c1] += d  # type promotion casts back to the model dtype in place

    def _add_shared(self, out: Tensor, x: Tensor, table: SharedTable) -> None:
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
        source = self._shared_of[layer] if self.shared else self.tables.slot_tables[layer]
        if site not in source:
            return None
        width = self.tables.modules[SITES[site][-1]].cols[1]
        out = x.new_zeros(*x.shape[:-1], width)
        return self.add_delta(out, x, layer, site)


__all__ = ["SITES", "AdapterBatch", "LayerLookup", "LoraTables", "Mode", "ModuleSpec", "module_layout"]
