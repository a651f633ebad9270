"""Medusa heads on a device: residual blocks over the base model's last hidden state, then a vocabulary projection.

``x`` is the final-normed hidden state the base ``lm_head`` reads (``Llama.forward``'s output at one position per
row), exactly what FasterDecoding/Medusa feeds its heads (``outputs[0]`` of the HF base model). Head ``h`` predicts
the token ``h + 2`` positions after the one ``x`` sits at: the base ``lm_head`` predicts the next one.

Layout: the weights of all heads are stacked, ``block_weight`` [n_layers, n_heads, hidden, hidden] and
``block_bias`` [n_layers, n_heads, hidden], so the first block of every head is one matmul (all heads read the same
``x``) and later blocks one ``bmm``. v1 heads stack their own projections in ``out_weight`` [n_heads, vocab, hidden];
v2 heads use the base ``lm_head`` and project all heads in one matmul.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from service import metrics
from service.adapters.medusa.format import MedusaSpec, check_heads_finite
from service.loading import LoadMode, load_tensors
from service.model.weights.protocol import EmbeddingTable

__all__ = ["MedusaHeads", "residual_blocks"]


def residual_blocks(x: Tensor, block_weight: Tensor, block_bias: Tensor) -> Tensor:
    """Every head's residual blocks ``y <- y + SiLU(W y + b)`` from the shared input x [B, H]; -> [B, n, H].

    block_weight [L, n, H, H], block_bias [L, n, H]. Differentiable (the training script uses it too).
    """
    n_layers, n, h = block_weight.shape[0], block_weight.shape[1], block_weight.shape[2]
    b = x.shape[0]
    if n_layers == 0:
        return x[:, None, :].expand(b, n, h)
    # Block 0: every head reads the same x, so all heads are one [n*H, H] matmul.
    z = F.linear(x, block_weight[0].reshape(n * h, h), block_bias[0].reshape(n * h))  # [B, n*H]
    y = x[:, None, :] + F.silu(z).view(b, n, h)  # [B, n, H]
    for layer in range(1, n_layers):
        z = torch.bmm(y.transpose(0, 1), block_weight[layer].transpose(1, 2)).transpose(0, 1)  # [B, n, H]
        y = y + F.silu(z + block_bias[layer])  # [B, n, H]
    return y


class MedusaHeads:
    def __init__(
        self, version: int, block_weight: Tensor, block_bias: Tensor, out_weight: Tensor | None = None
    ) -> None:
        if version not in (1, 2):
            raise ValueError(f"version must be 1 or 2, got {version}")
        if block_weight.dim() != 4 or block_weight.shape[-1] != block_weight.shape[-2]:
            raise ValueError(
                f"block_weight must be [n_layers, n_heads, hidden, hidden], got {tuple(block_weight.shape)}"
            )
        n_layers, n_heads, hidden, _ = block_weight.shape
        if tuple(block_bias.shape) != (n_layers, n_heads, hidden):
            raise ValueError(f"block_bias must be {(n_layers, n_heads, hidden)}, got {tuple(block_bias.shape)}")
        if (version == 1) != (out_weight is not None):
            raise ValueError("version 1 heads need out_weight; version 2 heads must not have one")
        if out_weight is not None and (
            out_weight.dim() != 3 or out_weight.shape[0] != n_heads or out_weight.shape[2] != hidden
        ):
            raise ValueError(f"out_weight must be [{n_heads}, vocab, {hidden}], got {tuple(out_weight.shape)}")
        if version == 2 and n_layers < 1:
            raise ValueError("version 2 heads need at least one residual block")
        self.version = version
        self.block_weight = block_weight  # [L, n, H, H]
        self.block_bias = block_bias  # [L, n, H]
        self.out_weight = out_weight  # [n, V, H] | None
        self.num_layers = int(n_layers)
        self.num_heads = int(n_heads)
        self.hidden_size = int(hidden)

    @classmethod
    def load(
        cls,
        spec: MedusaSpec,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        mode: LoadMode = "stream",
        opener: Callable[[Path], int] | None = None,
    ) -> MedusaHeads:
        """Allocate the stacked buffers on ``device`` in ``dtype`` and stream the spec's tensors into their views
        (files opened by ``opener``, see ``load_tensors``); refuse a tensor with NaN or inf (``NonFiniteTensor``)."""
        device = torch.device(device)
        n, layers, hidden = spec.num_heads, spec.num_layers, spec.hidden_size
        block_weight = torch.empty(layers, n, hidden, hidden, dtype=dtype, device=device)
        block_bias = torch.empty(layers, n, hidden, dtype=dtype, device=device)
        out_weight = torch.empty(n, spec.vocab_size, hidden, dtype=dtype, device=device) if spec.version == 1 else None
        plan: dict[str, Tensor] = {}
        for h, head in enumerate(spec.heads):
            for layer, block in enumerate(head.blocks):
                plan[block.weight.name] = block_weight[layer, h]
                plan[block.bias.name] = block_bias[layer, h]
            if head.out is not None and out_weight is not None:
                plan[head.out.name] = out_weight[h]
        load_tensors(spec.records(), plan, mode=mode, unexpected="error", opener=opener)
        t0 = time.perf_counter()
        try:
            check_heads_finite(spec, plan)  # in the serving dtype: a value too large for it is refused too
        finally:
            metrics.ADAPTER_LOAD_DURATION.labels(stage="validate", tier="disk").observe(time.perf_counter() - t0)
        return cls(spec.version, block_weight, block_bias, out_weight)

    @property
    def device(self) -> torch.device:
        return self.block_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.block_weight.dtype

    @property
    def nbytes(self) -> int:
        tensors = [self.block_weight, self.block_bias] + ([self.out_weight] if self.out_weight is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def hidden(self, x: Tensor) -> Tensor:
        """x [B, H] -> every head's state after its residual blocks, [B, n, H] (in the heads' dtype)."""
        return residual_blocks(x.to(self.dtype), self.block_weight, self.block_bias)

    def _project(self, y: Tensor, lm_head: Tensor | EmbeddingTable) -> Tensor:
        """y [B, n, H] -> logits [B, n, V] in the weights' dtype (a compact head's: its own, float32 from a kernel)."""
        if self.out_weight is None:
            if not isinstance(lm_head, Tensor):
                return lm_head.project(y)
            return F.linear(y.to(lm_head.dtype), lm_head)  # [B, n, V]
        return torch.bmm(y.transpose(0, 1), self.out_weight.transpose(1, 2)).transpose(0, 1)  # [B, n, V]

    @torch.inference_mode()
    def logits(self, x: Tensor, lm_head: Tensor | EmbeddingTable) -> Tensor:
        """x [B, H] -> fp32 logits [B, n, V]. ``lm_head`` [V, H] is the base model's (v2 heads project with it)."""
        return self._project(self.hidden(x), lm_head).float()

    @torch.inference_mode()
    def draft(self, x: Tensor, lm_head: Tensor | EmbeddingTable) -> Tensor:
        """x [B, H] -> [B, n] int64: head h's most likely token for position +h+2 (a top-1 chain of n drafts)."""
        return self._project(self.hidden(x), lm_head).argmax(dim=-1)

    @torch.inference_mode()
    def draft_with_confidence(self, x: Tensor, lm_head: Tensor | EmbeddingTable) -> tuple[Tensor, Tensor]:
        """x [B, H] -> (top-1 ids [B, n] int64, their softmax probabilities [B, n] fp32).

        The probabilities let a caller verify only drafts likely to be accepted (see ``loop.generate``).
        """
        ids, probs = self.candidates(x, lm_head, 1)
        return ids[..., 0], probs

    @torch.inference_mode()
    def candidates(self, x: Tensor, lm_head: Tensor | EmbeddingTable, k: int) -> tuple[Tensor, Tensor]:
        """x [B, H] -> (each head's ``k`` most likely ids [B, n, k] int64, the top-1 probability [B, n] fp32).
        The probability costs a log-sum-exp over the vocabulary: without a threshold, ``topk`` suffices."""
        logits = self._project(self.hidden(x), lm_head).float()  # [B, n, V]
        top = logits.topk(k, dim=-1)
        return top.indices, torch.exp(top.values[..., 0] - torch.logsumexp(logits, dim=-1))

    @torch.inference_mode()
    def topk(self, x: Tensor, lm_head: Tensor | EmbeddingTable, k: int) -> Tensor:
        """x [B, H] -> [B, n, k] int64: each head's ``k`` most likely tokens, most likely first."""
        return self._project(self.hidden(x), lm_head).topk(k, dim=-1).indices

    def __repr__(self) -> str:
        return (
            f"MedusaHeads(version={self.version}, heads={self.num_heads}, layers={self.num_layers}, "
            f"hidden={self.hidden_size}, dtype={self.dtype}, device={self.device}, nbytes={self.nbytes})"
        )
