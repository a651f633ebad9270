"""Dense copies of a model's compact weights, within a memory budget (``--dense-copies-mb``).

Memory traded for speed at large batches: a kept copy multiplies by a dense matmul from ``DENSE_COPY_FROM_ROWS``
rows on, with no dequantize to pay for. The head goes first (the slowest at large batches without one), then the
projections layer by layer. Not re-exported by the package: it walks a ``Llama``, which imports the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from service.model.llama import Llama

__all__ = ["keep_dense_copies"]


def keep_dense_copies(model: Llama, budget_bytes: int | None) -> int:
    """Keep dense copies of ``model``'s compact weights while they fit in ``budget_bytes`` (None: all), for large
    batches (``Weight.with_dense_copy``; a compact head's ``keep_dense``). Returns the bytes added."""
    left = budget_bytes
    added = 0
    head = model.lm_head
    if not isinstance(head, Tensor):
        size = head.shape[0] * head.shape[1] * model.dtype.itemsize
        if left is None or size <= left:
            added += head.keep_dense()
            left = None if left is None else left - size
    for layer, name, w in model.compact_projections():
        if w.dense is not None:
            continue
        size = w.shape[0] * w.shape[1] * w.dtype.itemsize
        if left is not None and size > left:
            return added
        model.set_projection(layer, name, w.with_dense_copy())
        added += size
        left = None if left is None else left - size
    return added
