"""The Llama-family model: config parsing, the fused-weight forward, the slot KV cache and weight loading.

``service.model.weights`` (``load_model``) depends on ``service.loading``; the rest stands alone.
"""

from __future__ import annotations

from service.model.config import FusedPart, ModelConfig, RopeScaling
from service.model.kv_cache import KVCache
from service.model.llama import AdapterHook, Llama, ProjName, proj

__all__ = ["AdapterHook", "FusedPart", "KVCache", "Llama", "ModelConfig", "ProjName", "RopeScaling", "proj"]
