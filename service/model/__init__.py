"""The Llama-family model: config parsing (``config``), the fused-weight forward (``llama``, RoPE in ``rope``), the
slot KV cache (``kv_cache``), the weight kinds (``weights``) and the loaders that build a model through
``service.loading``: a Hugging Face folder (``load_folder``) or a GGUF file (``load_gguf``).

A config refuses what cannot run, by name, before any weight is read; the model holds no per-request state (the
engine owns rows, lengths and slots) and never reads files itself. Public names are re-exported here.
"""

from __future__ import annotations

from service.model.config import FusedPart, ModelConfig, RopeScaling
from service.model.kv_cache import KVCache
from service.model.llama import AdapterHook, Llama, ProjName, proj
from service.model.load_folder import build_load_plan, load_model

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
