"""The adapters package's data types: the contract between the store and the batched LoRA math, and the
store's observable state.

The store (``service.adapters.lora.store``) reads an adapter's tensors, scales them and lays them out as
``LoraLayer`` objects on the serving device; the math (``service.adapters.lora.batch``) only ever sees these.
Module names are the PEFT / Hugging Face names of a Llama layer's projections. ``AdapterInfo`` and
``StoreState`` are the snapshots the store hands to the API, the metrics and the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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
