"""The batched LoRA math: one engine step's rows, each with its own adapter (or none), through one forward pass.

``AdapterBatch.build`` makes the batch of one forward pass (``None`` when no row has an adapter: such a batch pays
nothing); the model calls ``add_delta`` (its ``AdapterHook``) on every projection. Only rows ``[lo, hi)``, from
the first to the last row with an adapter, are touched; a base-only row inside that span meets zero weights
(per-slot) or is not in any group (shared), so its output is unchanged bit for bit. Each (layer, site) is computed
one of two ways over the tables of ``service.adapters.lora.tables``, chosen per batch from the number ``N`` of
distinct adapters among the ``b`` rows of the span:

- **per-slot** (``2 * N > b``, e.g. 32 rows with 32 adapters): ``h = x @ a^T`` ``[b, T, R]`` and
  ``out[..., cols_m] += h[..., seg_m] @ bt[m]``: one bmm plus one bmm and one add per module, whatever the mix of
  ranks and target subsets. A request joining or leaving rewrites only its own slot.
- **shared** (``N == 1`` or ``2 * N <= b``, several rows per adapter): the span's rows are gathered once per
  site into ``[G, k]`` groups, one per distinct adapter (padded to the largest group with copies of the group's own
  first row; no gather when the rows already lie that way), then one grouped bmm per product over the set's
  stacked tables: ``h = x_g @ A_g^T`` ``[G, k*T, R]``, ``d_m = h[..., seg_m] @ B_m,g^T``, and ``d_m`` goes back to
  its rows (``index_select`` + add, or ``index_add_`` where base-only rows lie inside the span). Reads each
  adapter's weights once per step where per-slot reads one copy per row, with the same number of kernel calls
  whatever ``N``; the groups are those of a kept set that holds the batch's adapters
  (``LoraTables.shared_order``: groups without rows are padding, never read back), rebuilt only when none does.

On the CPU with loraplex's compiled kernels loaded (``LoraTables.native``: ``Llama.lora_native``, which the
start-up self-check drops if it computes wrong), each (layer, site) of either layout is instead one call of
``NativeKernels.lora_delta`` over the span's rows in place: each row's table row (its group, or its slot; -1 for a
base-only row, which the kernel never touches), every module's shrink and expand and the DoRA scale and bias in
one pass, each adapter's weights read once per step, no gather or scatter (``service/kernels/src/lora.cpp``). Its
sums run in one fixed order per row, so a row's result does not depend on its batch or the layout.

Row isolation is structural in both: a row's input meets only its own adapter's weights (per-slot: its own table
row in a ``bmm``; shared: its own group), so no value of one row (a NaN, an inf) can reach another row's output;
nothing relies on multiplying other rows' deltas by zero.

DoRA rows carry a per-row, per-channel ``scale`` on the modules that have one: the module's columns become
``scale ⊙ (base + delta)`` in one float32 pass with one rounding (ones in the other rows, which therefore keep
their values exactly); a batch without a DoRA row pays nothing. A trained LoRA bias is part of the delta
(``B(Ax) + bias``, scaled), added per row before the delta reaches the output (zeros in other rows).

The model-level parts (``LoraLayer`` at the pseudo-layer ``num_layers``: LoRA on embed_tokens / lm_head, saved
embedding, final norm and head) and each layer's saved norms (``LoraLayer.saved``) are applied per key: the rows of
a key are gathered, recomputed with the key's weights (``F.embedding`` with its table, the norm with its weight) or
given its LoRA delta, and written back; ``head_parts`` groups ``logits``' states by head. A batch whose keys have
none of these pays a dict lookup per norm.

A row's *key* is whatever the caller groups rows by (an adapter id, or a weighted mixture of adapters that the
caller composes into one ``LoraLayer`` per layer, ``service.adapters.lora.mix``); the math only ever sees the
``LoraLayer`` a key maps to.

Which layout wins at which ``N`` is measured by ``bench/adapters_math.py --compare`` (figures in
``bench/README.md``): with all seven projections targeted, shared is ahead from one to 32 adapters over 32
rows; per-slot is kept where each row has its own adapter, since there the set changes with every request.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Final, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from service.adapters.lora.layouts import SITES, ModuleSpec, SharedTable, SlotTable, module_layout
from service.adapters.lora.tables import LoraTables
from service.adapters.lora.types import LoraLayer
from service.kernels.lora import StackLora
from service.model.hooks import PROJ_NAMES, HeadPart, NormName, NormWith, ProjName

# Shared mode while each distinct adapter has at least this many rows on average (bench/README.md, "LoRA on every
# projection").
SHARED_MIN_ROWS_PER_ADAPTER: Final = 2
NORMS: Final = frozenset(get_args(NormName))  # the norms an adapter may replace (then not in one call)

LayerLookup = Callable[[Hashable, int], LoraLayer | None]
Mode = Literal["auto", "slots", "shared"]


class AdapterBatch:
    """Built once per forward pass from the rows' adapters; every projection of every layer reads it."""

    def __init__(
        self,
        tables: LoraTables,
        lookup: LayerLookup,
        span_ids: list[Hashable | None],
        *,
        lo: int,
        rows: int,
        slot_start: int,
        mode: Mode,
        owners: Sequence[object] | None = None,
    ) -> None:
        self.tables = tables
        self._owners = None if owners is None else tuple(owners)  # see ``build``
        self.rows = rows  # B: the batch rows the model will pass
        self.span = (lo, lo + len(span_ids))  # [lo, hi): first to last row with an adapter
        self.slot_start = slot_start
        self._lookup = lookup
        self._span_ids = span_ids
        self._distinct: list[Hashable] = sorted({a for a in span_ids if a is not None})  # type: ignore[type-var]
        n = len(self._distinct)
        auto = n == 1 or n * SHARED_MIN_ROWS_PER_ADAPTER <= len(span_ids) or tables.holds(self._distinct)
        self.shared = mode == "shared" or (mode == "auto" and auto)
        # Shared math's row moves (see _plan_groups); None where no move is needed.
        self._gather: Tensor | None = None
        self._back: Tensor | None = None
        self._real_rows: Tensor | None = None
        self._row_group: Tensor | None = None  # per span row with an adapter, its group (shared DoRA scales)
        self._groups: tuple[Hashable, ...] = ()  # shared: the keys of the table's groups, a superset of _distinct
        if self.shared:
            self._groups = tables.shared_order(self._distinct)
            self._plan_groups(span_ids, tables.device)
        # The compiled kernel's row -> table row (shared: the group, per-slot: the slot; -1: no adapter), or None.
        self._kernel_rows: Tensor | None = None
        if tables.native is not None:
            first = slot_start + lo
            group = {a: gi for gi, a in enumerate(self._groups)}
            table_rows = [-1 if a is None else group[a] if self.shared else first + i for i, a in enumerate(span_ids)]
            self._kernel_rows = torch.tensor(table_rows, dtype=torch.int64)
        self._synced = [False] * tables.num_layers
        self._shared_of: list[dict[str, SharedTable]] = [{} for _ in range(tables.num_layers)]
        self._saved_of: list[dict[Hashable, Mapping[str, Tensor]]] = [{} for _ in range(tables.num_layers)]
        self._model_of: dict[Hashable, LoraLayer] | None = None  # the pseudo-layer's parts, per key (see _model)
        self._rows: dict[Hashable, Tensor] = {}

    @classmethod
    def build(
        cls,
        row_adapters: Sequence[Hashable | None],
        layer_lookup: LayerLookup,
        tables: LoraTables,
        *,
        slot_start: int = 0,
        rows_per_item: int | Sequence[int] = 1,
        mode: Mode = "auto",
        owners: Sequence[object] | None = None,
    ) -> AdapterBatch | None:
        """The batch for rows ``[slot_start, slot_start + B)`` of the KV cache, or ``None`` if no row has an adapter.

        ``row_adapters[i]`` is item ``i``'s adapter id (``None``: the base model); item ``i`` spans
        ``rows_per_item`` consecutive batch rows (an int for all, or one count per item), so ``B`` is their sum.
        ``layer_lookup(adapter_id, layer)`` returns that adapter's ``LoraLayer`` for ``layer`` on the tables'
        device (``None`` if the adapter leaves the layer alone); it is called once per distinct adapter and layer,
        the first time the forward pass reaches the layer. ``mode`` forces the per-slot or shared layout
        (tests, benchmarks); ``"auto"`` picks by the number of rows per distinct adapter. ``owners`` (one object
        per item, e.g. its request) lets batches of the same items share one compiled stack (``stack_lora``): an
        item's ``layer_lookup`` must give the same objects while it lives (its adapter held), as the engine's do.
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
        if owners is not None and len(owners) != len(row_adapters):
            raise ValueError(f"{len(owners)} owners for {len(row_adapters)} items")
        b = len(per_row)
        return cls(tables, layer_lookup, span, lo=lo, rows=b, slot_start=slot_start, mode=mode, owners=owners)

    def _sync(self, layer: int) -> None:
        """Bring the layer's tables up to date on the first visit of this forward pass."""
        looked = {a: self._lookup(a, layer) for a in self._distinct}
        self._saved_of[layer] = {a: lora.saved for a, lora in looked.items() if lora is not None and lora.saved}
        found = {a: lora if lora is not None and lora.modules else None for a, lora in looked.items()}
        if self.shared:
            self._shared_of[layer] = self.tables.sync_shared(layer, self._groups, found)
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
        tables = self._shared_of[layer] if self.shared else self.tables.slot_tables[layer]
        table: SharedTable | SlotTable | None = tables.get(name)
        if table is None:
            return out
        native, rows = self.tables.native, self._kernel_rows
        if native is not None and rows is not None and out.is_contiguous() and x.dtype == out.dtype:
            native.lora_delta(self.tables.kernel_of(table), out[lo:hi], x[lo:hi].contiguous(), rows)
        elif isinstance(table, SharedTable):
            self._add_shared(out[lo:hi], x[lo:hi], table)
        else:
            self._add_slots(out[lo:hi], x[lo:hi], table)
        return out

    def _add_slots(self, out: Tensor, x: Tensor, table: SlotTable) -> None:
        # x [b, T, in], out [b, T, out_fused]: views of the span's rows
        first = self.slot_start + self.span[0]
        slots = slice(first, first + x.shape[0])
        h = torch.bmm(x.to(self.tables.compute_dtype), table.a[slots].transpose(1, 2))  # [b, T, R]
        for module, width in table.ranks.items():
            off = table.offsets[module]
            c0, c1 = self.tables.modules[module].cols
            d = torch.bmm(h[..., off : off + width], table.bt[module][slots])  # [b, T, out_m]
            bias = table.bias.get(module)
            if bias is not None:
                d += bias[slots].unsqueeze(1)  # zeros in rows without a trained bias
            scale = table.scale.get(module)
            if scale is None:
                out[..., c0:c1] += d  # type promotion casts back to the model dtype in place
            else:
                _rescaled(out[..., c0:c1], d, scale[slots])

    def _plan_groups(self, span_ids: list[Hashable | None], device: torch.device) -> None:
        """The shared math's row moves, once per batch: span rows -> [G, k] groups (padded to the largest group
        with copies of the group's own first row) and the deltas back to their rows. ``None``: no move needed."""
        groups = [[i for i, row in enumerate(span_ids) if row == a] for a in self._groups]
        k = max(len(g) for g in groups)
        gather = [g[j] if j < len(g) else g[0] if g else 0 for g in groups for j in range(k)]  # a rowless group: pad
        at = {row: gi * k + j for gi, g in enumerate(groups) for j, row in enumerate(g)}
        real = [i for i, a in enumerate(span_ids) if a is not None]  # span rows with an adapter, in order
        back = [at[row] for row in real]
        group = {a: gi for gi, a in enumerate(self._groups)}
        self._row_group = torch.tensor([group[span_ids[i]] for i in real], dtype=torch.int64, device=device)

        def index(ix: list[int], identity: bool) -> Tensor | None:
            return None if identity else torch.tensor(ix, dtype=torch.int64, device=device)

        self._gather = index(gather, gather == list(range(len(span_ids))))
        self._back = index(back, back == list(range(len(gather))))
        self._real_rows = index(real, len(real) == len(span_ids))

    @property
    def row_moves(self) -> dict[str, list[int] | None]:
        """The shared math's row moves (span-relative; ``None``: no move): ``gather`` builds the padded groups,
        ``back`` picks each adapter row's delta from them, ``rows`` are the span rows that receive one."""
        moves = {"gather": self._gather, "back": self._back, "rows": self._real_rows}
        return {k: None if v is None else [int(i) for i in v.tolist()] for k, v in moves.items()}

    def _add_shared(self, out: Tensor, x: Tensor, table: SharedTable) -> None:
        # x [b, T, in], out [b, T, out_fused]: views of the span's rows. One grouped bmm per product: each group's
        # rows meet only its own adapter's weights (no masking by zero, where 0 * NaN would leak across rows).
        t, g = x.shape[1], table.a.shape[0]
        xg = x if self._gather is None else x.index_select(0, self._gather)  # [G*k, T, in]
        xg = xg.to(self.tables.compute_dtype).reshape(g, -1, x.shape[-1])  # [G, k*T, in]
        h = torch.bmm(xg, table.a.transpose(1, 2))  # [G, k*T, R]
        for seg in table.segs:
            c0, c1 = self.tables.modules[seg.module].cols
            d = torch.bmm(h[..., seg.start : seg.stop], seg.bt)  # [G, k*T, out_m]
            if seg.bias is not None:
                d += seg.bias.unsqueeze(1)  # each group's own adapter's bias (zeros for one without)
            d = d.view(-1, t, c1 - c0)  # [G*k, T, out_m]
            if self._back is not None:
                d = d.index_select(0, self._back)  # [n, T, out_m]: the span's rows with an adapter, in order
            if seg.scale is not None:
                self._rescaled_shared(out[..., c0:c1], d, seg.scale)
            elif self._real_rows is None:
                out[..., c0:c1] += d  # type promotion casts back to the model dtype in place
            else:
                out[..., c0:c1].index_add_(0, self._real_rows, d.to(out.dtype))

    def _rescaled_shared(self, cols: Tensor, d: Tensor, scale: Tensor) -> None:
        """``cols`` of the span's rows with an adapter become ``scale ⊙ (cols + d)`` (their group's ``scale``)."""
        groups = self._row_group
        assert groups is not None
        per_row = scale.index_select(0, groups)  # [n, out_m]
        if self._real_rows is None:
            _rescaled(cols, d, per_row)
            return
        picked = cols.index_select(0, self._real_rows)  # [n, T, out_m]
        _rescaled(picked, d, per_row)
        cols.index_copy_(0, self._real_rows, picked)

    def stack_lora(self) -> StackLora | None:
        """``AdapterHook.stack_lora``: every layer synced and its tables compiled (as ``add_delta`` would), or None
        where the per-op path is needed (no compiled kernel, a saved norm weight)."""
        rows, layers = self._kernel_rows, self.tables.num_layers
        if self.tables.native is None or rows is None or any(NORMS & p.saved.keys() for p in self._model().values()):
            return None
        key = self._stack_key()
        if (kept := self.tables.kept_stack(key)) is not None:
            return kept
        sites, keep = (ctypes.c_int64 * (layers * len(PROJ_NAMES)))(), []
        for layer in range(layers):
            if not self._synced[layer]:
                self._sync(layer)
            if any(NORMS & saved.keys() for saved in self._saved_of[layer].values()):
                return None
            tables = self._shared_of[layer] if self.shared else self.tables.slot_tables[layer]
            for j, name in enumerate(PROJ_NAMES):
                if (table := tables.get(name)) is not None:
                    site = self.tables.kernel_of(table)
                    sites[layer * len(PROJ_NAMES) + j] = ctypes.addressof(site.fields)
                    keep.append(site)
        stack = StackLora(sites, self.span, rows, tuple(keep))
        self.tables.keep_stack(key, self._owners, stack)
        return stack

    def _stack_key(self) -> tuple[Hashable, ...] | None:
        """What a compiled stack depends on beside the tables (their generation) and the items' layer objects
        (``build``'s ``owners``): the rows, their keys and slots, the layout. None without owners."""
        if self._owners is None:
            return None
        owners = tuple(id(o) for o in self._owners)
        return owners, tuple(self._span_ids), self.slot_start, self.span, self.rows, self.shared, self._groups

    # --- the embedding, the norms and the head (LoRA on embed_tokens / lm_head, modules_to_save) ------------------

    def _model(self) -> dict[Hashable, LoraLayer]:
        """Each key's pseudo-layer (index ``num_layers``: the model-level parts), looked up on first use."""
        if self._model_of is None:
            top = self.tables.num_layers
            looked = {a: self._lookup(a, top) for a in self._distinct}
            self._model_of = {a: lora for a, lora in looked.items() if lora is not None}
        return self._model_of

    def _rows_of(self, key: Hashable) -> Tensor:
        """[n] int64: the batch rows whose key is ``key``."""
        rows = self._rows.get(key)
        if rows is None:
            lo = self.span[0]
            at = [lo + i for i, a in enumerate(self._span_ids) if a == key]
            rows = self._rows[key] = torch.tensor(at, dtype=torch.int64, device=self.tables.device)
        return rows

    def embed(self, x: Tensor, tokens: Tensor) -> Tensor:
        """``AdapterHook.embed``: a row's saved embedding replaces the base one; LoRA on it adds
        ``A.T[token] @ B.T`` (B scaled), as PEFT's ``Embedding`` does."""
        for key, part in self._model().items():
            table, lora = part.saved.get("embed_tokens"), part.modules.get("embed_tokens")
            if table is None and lora is None:
                continue
            idx = self._rows_of(key)
            tok = tokens.index_select(0, idx)  # [n, T]
            rows = x.index_select(0, idx) if table is None else F.embedding(tok, table).float()  # [n, T, hidden]
            if lora is not None:
                rows += F.embedding(tok, lora.a.t()) @ lora.b.t()  # [n, T, r] @ [r, hidden]
            x.index_copy_(0, idx, rows)
        return x

    def norm(self, out: Tensor, x: Tensor, layer: int, name: NormName, norm_with: NormWith) -> Tensor:
        """``AdapterHook.norm``: the rows of a key with a saved weight for this norm, normed with it."""
        if layer < self.tables.num_layers:
            if not self._synced[layer]:
                self._sync(layer)
            saved = self._saved_of[layer]
        else:
            saved = {a: part.saved for a, part in self._model().items() if part.saved}
        for key, weights in saved.items():
            w = weights.get(name)
            if w is not None:
                idx = self._rows_of(key)
                out.index_copy_(0, idx, norm_with(x.index_select(0, idx), w))
        return out

    def head_parts(self, rows: Sequence[int] | None, n: int) -> list[HeadPart] | None:
        """``AdapterHook.head_parts``: states grouped by their key's head (saved, LoRA on it, or the base's)."""
        heads = {a: p for a, p in self._model().items() if "lm_head" in p.saved or "lm_head" in p.modules}
        if not heads:
            return None
        lo, hi = self.span
        groups: dict[Hashable, list[int]] = {}
        for i, row in enumerate(range(n) if rows is None else rows):
            key = self._span_ids[row - lo] if lo <= row < hi else None
            groups.setdefault(key if key in heads else None, []).append(i)
        parts = []
        for key, members in groups.items():
            idx = torch.tensor(members, dtype=torch.int64, device=self.tables.device)
            part = heads.get(key) if key is not None else None
            lora = part.modules.get("lm_head") if part is not None else None
            weight = part.saved.get("lm_head") if part is not None else None
            parts.append(HeadPart(idx, weight, None if lora is None else lora.a, None if lora is None else lora.b))
        return parts

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


def _rescaled(cols: Tensor, d: Tensor, scale: Tensor) -> None:
    """``cols`` [n, T, out_m] <- ``scale ⊙ (cols + d)`` (``scale`` [n, out_m] per row), in float32, rounded once."""
    cols.copy_((cols.float() + d).mul_(scale.unsqueeze(1)))


__all__ = ["SITES", "AdapterBatch", "LayerLookup", "LoraTables", "Mode", "ModuleSpec", "module_layout"]
