"""The adapter seam of the decoder: what a batch of per-row adapters provides to ``Llama`` (implemented by
``service.adapters.lora.batch.AdapterBatch``).

The model calls the hook at four kinds of places, each with the base result already computed, so a batch whose rows
leave a place alone costs one method call there:

- every projection (``add_delta``): the input and the base output of ``wqkv`` / ``wo`` / ``w13`` / ``w2``;
- the token embedding (``embed``): the float32 residual stream as the base embedding made it, and the tokens;
- every RMSNorm (``norm``): the norm's input and its base output (per layer ``input_layernorm`` and
  ``post_attention_layernorm``, then the final ``norm`` at layer index ``num_layers``);
- the output head (``head_parts``): which rows project with what, asked once per ``Llama.logits`` call;
- a decode step in one compiled call (``stack_lora``): all the projections' deltas as compiled tables, up front.

Nothing here imports the adapters package: the model sees only tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from torch import Tensor

from service.kernels.lora import StackLora

ProjName = Literal["wqkv", "wo", "w13", "w2"]
PROJ_NAMES: tuple[ProjName, ...] = ("wqkv", "wo", "w13", "w2")
NormName = Literal["input_layernorm", "post_attention_layernorm", "norm"]  # PEFT / Hugging Face names
NormWith = Callable[[Tensor, Tensor], Tensor]  # (x, weight) -> the norm of x with that weight, as the base computes it


@dataclass(frozen=True)
class HeadPart:
    """Rows of one ``logits`` call that project the same way: with ``weight`` (a replaced head) or the base head,
    plus a LoRA delta ``(x @ a.T) @ b.T`` when ``a`` is set (``b`` carries the scaling)."""

    index: Tensor  # [n] int64 positions along the first dim of the hidden states given to ``logits``
    weight: Tensor | None = None  # [vocab, hidden] a modules_to_save head; None: the base head
    a: Tensor | None = None  # [r, hidden] LoRA on lm_head
    b: Tensor | None = None  # [vocab, r]


class AdapterHook(Protocol):
    """What a batch of per-row adapters must provide to the model (see the module docstring)."""

    def add_delta(self, out: Tensor, x: Tensor, layer: int, name: ProjName) -> Tensor:
        """Return ``out`` plus this batch's adapter delta for projection ``name`` of ``layer``.

        ``x`` is the projection's input ``[B, T, in]``; ``out`` its base output ``[B, T, out]`` whose columns follow
        the fused layout of ``ModelConfig.fused_rows`` for ``wqkv`` and ``w13``. May update ``out`` in place.
        """
        ...

    def embed(self, x: Tensor, tokens: Tensor) -> Tensor:
        """``x`` [B, T, hidden] float32 (the base embedding of ``tokens`` [B, T]) with each row's embedding
        replacement or LoRA delta applied. May update ``x`` in place."""
        ...

    def norm(self, out: Tensor, x: Tensor, layer: int, name: NormName, norm_with: NormWith) -> Tensor:
        """``out`` (the base norm of ``x``) with the rows of a replaced norm weight recomputed by ``norm_with``."""
        ...

    def stack_lora(self) -> StackLora | None:
        """Every layer's projection deltas as compiled LoRA tables, for a decode step in one call
        (``service.model.decode_stack``); None when the batch needs the per-op path (no compiled tables, a replaced
        norm). The embedding and the head stay with ``embed`` and ``head_parts``."""
        ...

    def head_parts(self, rows: Sequence[int] | None, n: int) -> list[HeadPart] | None:
        """How the ``n`` hidden states of a ``logits`` call project (``rows[i]``: the batch row of state ``i``;
        None: state ``i`` is row ``i``). None when every one uses the base head alone (the common case)."""
        ...


__all__ = ["PROJ_NAMES", "AdapterHook", "HeadPart", "NormName", "NormWith", "ProjName"]
