"""The model-level parts of one batch's rows: LoRA on ``embed_tokens`` / ``lm_head`` and the ``modules_to_save``
of the embeddings, the head and the final norm, each applied to its own rows only.

``RowTops`` is built once per forward pass from the batch's row keys; it looks each distinct key's ``LoraTop`` up
on first use and groups the batch rows by the key that brings a part, so a row's values never meet another row's
weights and rows without a part are left exactly as they are. The math is float32 throughout (the embeddings enter
the float32 residual stream; logits are float32), so a row's part costs one gather or one small matmul of its own
rows. A batch whose rows bring no model-level part pays one lookup per distinct key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from service.adapters.lora.types import LoraTop

TopLookup = Callable[[Hashable], LoraTop | None]


class RowTops:
    """The model-level parts of one forward pass's rows (see the module docstring)."""

    def __init__(self, lookup: TopLookup | None, row_keys: Sequence[Hashable | None], device: torch.device) -> None:
        self._lookup = lookup
        self._keys = list(row_keys)  # per batch row
        self._device = device
        self._groups: list[tuple[LoraTop, list[int]]] | None = None  # (parts, batch rows), built on first use

    def groups(self) -> list[tuple[LoraTop, list[int]]]:
        """Each distinct key's parts with the batch rows that use them (keys with no part left out)."""
        if self._groups is None:
            rows: dict[Hashable, list[int]] = {}
            for b, key in enumerate(self._keys):
                if key is not None:
                    rows.setdefault(key, []).append(b)
            found = [(self._lookup(key), ix) for key, ix in rows.items()] if self._lookup is not None else []
            self._groups = [(top, ix) for top, ix in found if top is not None]
        return self._groups

    def embed(self, x: Tensor, tokens: Tensor) -> Tensor:
        """``x`` [B, T, hidden] float32 embeddings of ``tokens`` [B, T]: a row's trained table replaces its rows,
        a row's embedding LoRA adds ``b @ a_t[token]``."""
        for top, rows in self.groups():
            if top.embed_tokens is None and top.embed is None:
                continue
            ix = self._index(rows)
            tok = tokens.index_select(0, ix)  # [n, T]
            if top.embed_tokens is not None:
                x.index_copy_(0, ix, top.embed_tokens[tok].float())
            if top.embed is not None:
                e = top.embed
                delta = torch.matmul(e.a_t[tok].float(), e.b.float().t())  # [n, T, r] @ [r, hidden]
                x.index_add_(0, ix, delta)
        return x

    def norm_weight(self, base: Tensor) -> Tensor | None:
        """Per-row weights [B, 1, hidden] of the final norm where some row's adapter replaces it; else None."""
        weights: Tensor | None = None
        for top, rows in self.groups():
            if top.norm is None:
                continue
            if weights is None:
                weights = base.expand(len(self._keys), 1, base.shape[-1]).clone()
            weights[self._index(rows), 0] = top.norm.to(weights.dtype)
        return weights

    def head(self, logits: Tensor, hidden: Tensor, rows: Sequence[int] | None) -> Tensor:
        """``logits`` [N, (T,) V] of ``hidden`` [N, (T,) H]: a row's trained head replaces its logits, a row's head
        LoRA adds ``b @ (a @ h)``; ``rows[i]`` is entry i's batch row (None: entry i is batch row i)."""
        groups = [(top, ix) for top, ix in self.groups() if top.head is not None or top.lm_head is not None]
        if not groups:
            return logits
        entry_of: dict[int, list[int]] = {}
        for i, b in enumerate(range(logits.shape[0]) if rows is None else rows):
            entry_of.setdefault(b, []).append(i)
        for top, batch_rows in groups:
            entries = [i for b in batch_rows for i in entry_of.get(b, ())]
            if not entries:
                continue
            ix = self._index(entries)
            h = hidden.index_select(0, ix).float()  # [n, (T,) H]
            if top.lm_head is not None:
                logits.index_copy_(0, ix, torch.matmul(h, top.lm_head.float().t()))
            if top.head is not None:
                lora = top.head
                logits.index_add_(0, ix, torch.matmul(torch.matmul(h, lora.a.float().t()), lora.b.float().t()))
        return logits

    def _index(self, rows: Sequence[int]) -> Tensor:
        return torch.tensor(list(rows), dtype=torch.int64, device=self._device)


__all__ = ["RowTops", "TopLookup"]
