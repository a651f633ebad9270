"""The Llama-family model: config parsing, the fused-weight forward, the slot KV cache and weight loading.

cfg = ModelConfig.from_hf(folder)                          # config.py: refuses what cannot run, by name
model, cfg, stats = load_model(folder, dtype=..., device=...)   # weights.py, through service.loading
cache = KVCache(cfg, slots, max_len, dtype=..., device=...)     # kv_cache.py
hidden = model(tokens, positions, cache, slot_start, adapters, kv_len=...)   # llama.py
logits = model.logits(Llama.gather_last(hidden, lengths))
"""

from __future__ import annotations

from service.model.config import FusedPart, ModelConfig, RopeScaling
from service.model.kv_cache import KVCache
from service.model.llama import AdapterHook, Llama, ProjName, proj
from service.model.weights import build_load_plan, load_model

__all__ = [
    "AdapterHook",
    "FusedPart",
    "KVCache",
    "Llama",
    "ModelConfig",
    "ProjName",
    "RopeScaling",
    "build_load_plan",
    "load_model",
    "proj",
]
