"""The seams between the model and the adapters: what an adapter batch must provide to the forward pass.

``AdapterHook`` adds per-row deltas to the projections; ``RowParts`` adapts what lies outside them (embeddings,
norms, head). Both are implemented in ``service.adapters``; the model imports only these protocols.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from torch import Tensor

ProjName = Literal["wqkv", "wo", "w13", "w2"]
NormName = Literal["input_layernorm", "post_attention_layernorm", "norm"]  # the PEFT / HF names


class AdapterHook(Protocol):
    """What a LoRA batch must provide to the model (implemented in ``service.adapters``)."""

    def add_delta(self, out: Tensor, x: Tensor, layer: int, name: ProjName) -> Tensor:
        """Return ``out`` plus this batch's adapter delta for projection ``name`` of ``layer``.

        ``x`` is the projection's input ``[B, T, in]``; ``out`` its base output ``[B, T, out]`` whose columns follow
        the fused layout of ``ModelConfig.fused_rows`` for ``wqkv`` and ``w13``. May update ``out`` in place.
        """
        ...


class RowParts(Protocol):
    """What an adapter batch gives the model outside the projections, per row (implemented in
    ``service.adapters``): LoRA on the embeddings and the head, and trained replacements of norms, embeddings and
    head. Rows whose adapter brings none of these keep the base model's values exactly."""

    def embed(self, x: Tensor, tokens: Tensor) -> Tensor:
        """``x`` [B, T, hidden] float32: the base embeddings of ``tokens`` [B, T]; returns them adapted per row."""
        ...

    def norm_weight(self, layer: int, name: NormName, base: Tensor) -> Tensor | None:
        """Per-row weights [B, 1, hidden] replacing norm ``name`` (of ``layer``; ``norm``: the final one) for the
        rows whose adapter trained it, the ``base`` weight in the others; None when no row has one."""
        ...

    def head(self, logits: Tensor, hidden: Tensor, rows: Sequence[int] | None) -> Tensor:
        """float32 ``logits`` [N, (T,) V] of ``hidden`` [N, (T,) H] adapted per row; ``rows[i]`` is entry i's batch
        row (None: entry i is batch row i)."""
        ...


__all__ = ["AdapterHook", "NormName", "ProjName", "RowParts"]
