"""The base model's projection weights one PEFT module at a time, as DoRA's weight norm needs them.

DoRA rescales each output channel by ``m / ||W + sBA||``, which needs the base weight ``W`` of the module itself,
whatever form the server holds it in: a dense fused tensor, or a compact one (int8, int4, a GGUF kind) that is
dequantized here, into a fresh float32 copy, for the norm only. The fused layout (``wqkv`` = [q; k; v], ``w13`` =
[gate; up]) is undone by row ranges of ``ModelConfig.fused_rows``. Nothing here is on the hot path: the adapter
store's loader calls it once per DoRA layer it loads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from service.model.llama import Llama
from service.model.weights.protocol import ProjWeight

# PEFT module -> (block attribute path, fused projection)
_SITE = {
    "q_proj": ("attention", "wqkv"),
    "k_proj": ("attention", "wqkv"),
    "v_proj": ("attention", "wqkv"),
    "o_proj": ("attention", "wo"),
    "gate_proj": ("feed_forward", "w13"),
    "up_proj": ("feed_forward", "w13"),
    "down_proj": ("feed_forward", "w2"),
}


class ModelBaseWeights:
    """``BaseWeights`` over a loaded ``Llama`` (see the module docstring)."""

    def __init__(self, model: Llama) -> None:
        self.model = model
        fused = model.cfg.fused_rows()
        self._rows: dict[str, tuple[int, int] | None] = {
            part.hf_name: (part.start, part.stop) for parts in fused.values() for part in parts
        }

    def weight(self, layer: int, module: str) -> Tensor:
        """float32 [out, in] copy of ``module``'s base weight in ``layer`` (dequantized if compact)."""
        if module not in _SITE:
            raise KeyError(f"{module!r} is not a projection of a Llama layer")
        if not 0 <= layer < self.model.cfg.num_layers:
            raise IndexError(f"layer {layer} is outside the model's {self.model.cfg.num_layers}")
        part, site = _SITE[module]
        fused: ProjWeight = getattr(getattr(self.model.blocks[layer], part), site)
        rows = self._rows.get(module)
        with torch.inference_mode(False), torch.no_grad():
            if isinstance(fused, Tensor):
                dense = fused if rows is None else fused[rows[0] : rows[1]]
                return dense.to(torch.float32, copy=True)
            full = fused.dequantize(torch.float32)  # [N, K]: exactly the values the kernel multiplies by
            return full if rows is None else full[rows[0] : rows[1]].clone()


__all__ = ["ModelBaseWeights"]
