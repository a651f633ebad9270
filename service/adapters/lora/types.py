"""The adapters package's data types: the contract between the store and the batched LoRA math, and the
store's observable state.

The store (``service.adapters.lora.store``) reads an adapter's tensors, scales them and lays them out as
``LoraLayer`` objects on the serving device; the math (``service.adapters.lora.batch``) only ever sees these.
Module names are the PEFT / Hugging Face names of a Llama layer's projections. ``AdapterInfo`` and
``StoreState`` are the snapshots the store hands to the API, the metrics and the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import torch
from torch import Tensor

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # PEFT/HF names
# Model-level LoRA targets: ``LoraModule``s of the pseudo-layer ``num_layers`` (embed_tokens: a [r, vocab],
# b [hidden, r]; lm_head: a [r, hidden], b [vocab, r]).
MODEL_MODULES = ("embed_tokens", "lm_head")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")  # a layer's modules_to_save, in ``LoraLayer.saved``


@dataclass(frozen=True)
class DoraNorm:
    """DoRA's magnitude and the terms of the squared row norm ``||W + w·sBA||²`` of one module, per output channel
    (float32, on the device), computed once when the layer loads (the base weight dequantized for this only).

    ``s`` is the adapter's scaling (already in ``LoraModule.b``) and ``w`` a request's weight on the adapter
    (``scale``): ``||W + w·sBA||² = base_sq + 2w·cross + w²·delta_sq``, so any weight costs three vector ops."""

    magnitude: Tensor  # [out] lora_magnitude_vector
    base_sq: Tensor  # [out] ||W_o||²
    cross: Tensor  # [out] <W_o, (sBA)_o>
    delta_sq: Tensor  # [out] ||(sBA)_o||²

    def rescale(self, weight: float = 1.0) -> Tensor:
        """[out] ``m / ||W + weight·sBA||``: DoRA's factor on the base output plus the (weighted) delta (PEFT's
        ``mag_norm_scale``)."""
        sq = self.base_sq + (2.0 * weight) * self.cross + (weight * weight) * self.delta_sq
        return self.magnitude / sq.clamp_min(0.0).sqrt()


@dataclass(frozen=True)
class LoraModule:
    """One target module of one layer, ready for the math, on its device and in the serving dtype.

    The module's output is ``rescale ⊙ (W x + b(a x)) + bias``; ``rescale`` (DoRA) and ``bias`` (a trained LoRA
    bias, PEFT's ``lora_bias``) are None when the adapter has none."""

    a: torch.Tensor  # [r, in_features]   lora_A.weight as PEFT stores it (fan_in_fan_out already handled)
    b: torch.Tensor  # [out_features, r]  lora_B.weight with the scaling (alpha/r or alpha/sqrt(r)) multiplied in
    dora: DoraNorm | None = None  # DoRA's terms (to rescale for another weight)
    rescale: Tensor | None = None  # [out] float32 DoRA factor for this module's weights as they are (dora.rescale(1))
    bias: Tensor | None = None  # [out] lora_B.bias with the scaling multiplied in, serving dtype

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoraLayer:
    """All target modules of one layer of one adapter; a module the adapter does not touch is absent.

    Layer index ``num_layers`` is the model-level pseudo-layer (``MODEL_MODULES``; a saved final norm, embed_tokens,
    lm_head). ``saved`` holds the weights that replace the base's for the adapter's rows (``modules_to_save``: a
    norm's [hidden], an embedding's or head's [vocab, hidden]), in the serving dtype."""

    modules: Mapping[str, LoraModule]
    nbytes: int
    saved: Mapping[str, Tensor] = field(default_factory=dict)


class BaseWeights(Protocol):
    """The base model's projection weights as DoRA's norm needs them (implemented in ``service.model``)."""

    def weight(self, layer: int, module: str) -> Tensor:
        """A float32 copy [out, in] of one module's base weight (dense, or dequantized: int8, int4, GGUF), on the
        model's device. Made on each call; the caller drops it."""
        ...


AdapterState = Literal["registered", "loading", "host", "device", "failed"]


@dataclass(frozen=True)
class AdapterInfo:
    """A snapshot of one adapter: what it is, where it lives, how it was used and how long it took to load."""

    id: str
    source: Path
    kind: str  # "lora"
    rank: int  # the largest rank over all modules and layers
    ranks: dict[str, int]  # per adapted module, the largest rank over the layers
    alpha: float  # lora_alpha (before alpha_pattern)
    target_modules: tuple[str, ...]  # modules with a delta in at least one layer
    rslora: bool
    layers: tuple[int, ...]  # layers with at least one delta
    state: AdapterState
    host_bytes: int  # bytes of the host-tier copy (0 when none)
    device_bytes: int  # bytes on the device tier (0 when not resident)
    hits: int  # request() calls that found it resident
    last_used: float | None  # time.time() of the last request hit / pin / unpin / load
    registered_at: float
    pins: int
    loads: int  # completed loads onto the device tier
    disk_reads: int  # loads that read the weights file (the others came from the host tier)
    disk_bytes: int  # bytes read from the weights file, all loads together
    index_seconds: float  # registration: config + header + validation
    read_seconds: float  # last load: reading the file (0 when it came from the host tier)
    layout_seconds: float  # last load: scaling, dtype conversion and copy onto the device
    total_seconds: float  # last load: from the request that queued it to resident (includes queueing)
    error: str | None
    dora: bool = False  # use_dora: the deltas are rescaled per output channel (DoRA)
    saved_modules: tuple[str, ...] = ()  # modules_to_save the adapter replaces (norms, embed_tokens, lm_head)
    evictions: int = 0  # times it left the device tier to make room for another


@dataclass(frozen=True)
class StoreState:
    """The whole store at one instant, for tests and metrics."""

    adapters: dict[str, AdapterInfo]
    device_bytes: int
    host_bytes: int
    device_budget_bytes: int
    host_budget_bytes: int
    device_lru: tuple[str, ...]  # resident on the device tier, least recently used first
    host_lru: tuple[str, ...]  # holding a host copy, least recently used first
    queued: tuple[str, ...]  # waiting for the loader, in order (the one being loaded is not listed)
    disk_reads: int
    disk_bytes: int
