"""The Llama-family model: config parsing (``config``), the fused-weight forward (``llama``), the slot KV cache
(``kv_cache``) and weight loading through ``service.loading`` (``weights``).

A config refuses what cannot run, by name, before any weight is read; the model holds no per-request state (the
engine owns rows, lengths and slots) and never reads files itself. Public names are re-exported here.
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
