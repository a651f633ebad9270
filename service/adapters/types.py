"""The data contract between the adapter store and the batched LoRA math.

The store (``service.adapters.store``) reads an adapter's tensors, scales them and lays them out as
``LoraLayer`` objects on the serving device; the math (``service.adapters.lora``) only ever sees these.
Module names are the PEFT / Hugging Face names of a Llama layer's projections.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # PEFT/HF names


@dataclass(frozen=True)
class LoraModule:
    """One target module of one layer, ready for the math, on its device and in the serving dtype."""

    a: torch.Tensor  # [r, in_features]   lora_A.weight as PEFT stores it (fan_in_fan_out already handled)
    b: torch.Tensor  # [out_features, r]  lora_B.weight with the scaling (alpha/r or alpha/sqrt(r)) multiplied in

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoraLayer:
    """All target modules of one layer of one adapter; a module the adapter does not touch is absent."""

    modules: Mapping[str, LoraModule]
    nbytes: int
