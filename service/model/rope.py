"""Rotary position embeddings as free functions: inverse frequencies (linear or llama3 rescaling), the cos / sin
tables and the rotation, computed as transformers does so logits match it bit for bit in float32."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from service.model.config import ModelConfig

__all__ = ["apply_rope", "rope_inv_freq", "rope_table"]


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies [D/2] in fp32 on the CPU, with linear or llama3 rescaling (as transformers)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [D/2]
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_table(inv_freq: Tensor, length: int, *, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and signed sin for positions ``[0, length)``, each [length, D], computed in fp32, stored in ``dtype``.

    ``cos`` repeats the half-table twice (as transformers); ``sin`` is ``[-sin, sin]`` so that rotating is
    ``x * cos + roll(x, D/2) * sin``, which equals transformers' ``x * cos + rotate_half(x) * sin``.
    """
    pos = torch.arange(length, device=device, dtype=torch.float32)  # [P]
    freqs = pos[:, None] * inv_freq.to(device)[None, :]  # [P, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head (the HF "rotate_half" convention). x [B, T, h, D]; cos, sin [B, T, 1, D]."""
    # Two rounded products and a sum, exactly as transformers (an addcmul would fuse and differ in the last bit).
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin  # [B, T, h, D]
