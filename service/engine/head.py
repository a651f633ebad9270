"""The vocabulary projection of a step's rows: their logits, or only each row's argmax where that is all they need.

A greedy row without a repetition penalty, logprobs or a grammar needs of its logits only the largest and its index
(``SamplingParams.argmax_only``). When every row of a step is such a row and projects through the base head, a head
that can find them without computing every logit (``EmbeddingTable.top``: the Q8_0 head's int8 screen,
``service.model.weights.q8_table``) gives them exactly; the runner then samples nothing. Past its kernel's rows
(a wide verification) the Q8_0 head also gives them, screened or not, from the kernel a plain step uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service import metrics
from service.adapters.lora.batch import AdapterBatch
from service.engine.row import Row
from service.model.llama import Llama

__all__ = ["Top", "project", "row_top"]

Top = tuple[torch.Tensor, torch.Tensor]  # each row's largest logit [B] float32 and its first index [B] int64
_SCREENED, _IN_FULL = (metrics.HEAD_SCREEN_ROWS.labels(outcome) for outcome in ("screened", "full"))


def project(
    model: Llama,
    rows: Sequence[Row],
    hidden: torch.Tensor,
    batch: AdapterBatch | None,
    unconstrained: bool,
    index: list[int] | None = None,
) -> tuple[torch.Tensor | None, Top]:
    """``(logits [N, V], top)`` of the hidden states [N, H] of ``rows`` (state ``i`` of ``rows[i]``, batch row
    ``index[i]``; None: ``i``), ``top`` their row max and first argmax; or ``(None, top)`` when every row needs
    only its argmax, no grammar needs the logits (``unconstrained``), the batch uses the base head alone and the
    head finds the argmax itself."""
    head = model.lm_head
    argmax_only = unconstrained and all(r.request.sampling.argmax_only for r in rows)
    if argmax_only and not isinstance(head, torch.Tensor):  # a dense head: logits, nothing more asked
        base_only = batch is None or batch.head_parts(index, len(rows)) is None
        if base_only and (top := head.top(hidden)) is not None:
            values, indices, found = top
            _SCREENED.inc(int((found > 0).sum()))
            _IN_FULL.inc(int((found == 0).sum()))  # -1: no screen ran (a CPU without one, past the kernel's rows)
            return None, (values, indices)
    logits = model.logits(hidden, batch, index)
    return logits, row_top(model, logits)


def row_top(model: Llama, logits: torch.Tensor) -> Top:
    """``logits.max(dim=-1)``'s values and indices [N] of logits [N, V]: NaN where a row holds NaN, +inf where it
    holds +inf, the first index of the largest; in one parallel pass on the compiled kernels (CPU float32)."""
    native = model.native
    if native is not None and logits.dtype == torch.float32 and logits.is_contiguous() and logits.dim() == 2:
        return native.row_top(logits)
    top = logits.max(dim=-1)
    return top.values, top.indices
