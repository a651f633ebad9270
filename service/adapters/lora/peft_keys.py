"""PEFT's tensor and module names for Llama projections: taken apart, rebuilt, and why a foreign one is refused.

Names are those of ``LlamaForCausalLM`` (``model.layers.{L}.self_attn.q_proj``), as saved by PEFT
(``base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight``, older files with an adapter-name infix).
Pure string work: nothing here reads a file.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from service.adapters.lora.types import MODULES
from service.model.config import ModelConfig

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GROUP = {m: ("self_attn" if m in ATTENTION else "mlp") for m in MODULES}


def module_key(layer: int, module: str) -> str:
    """PEFT's full name of one projection of ``LlamaForCausalLM``."""
    return f"model.layers.{layer}.{GROUP[module]}.{module}"


def module_features(model_config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each projection of one layer."""
    hidden = model_config.hidden_size
    q = model_config.num_heads * model_config.head_dim
    kv = model_config.num_kv_heads * model_config.head_dim
    inter = model_config.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


class LoraKey(NamedTuple):
    """One PEFT tensor name, taken apart: ``{prefix}layers.{layer}.{group}.{module}.lora_{matrix}{infix}.weight``."""

    prefix: str  # "base_model.model.model." for a causal LM
    layer: int
    module: str
    matrix: str  # "A" | "B"
    infix: str  # "" or ".<adapter name>" (older files)


LORA_KEY = re.compile(
    r"(?P<prefix>(?:base_model\.model\.)?(?:model\.)?)layers\.(?P<layer>\d+)\.(?P<group>self_attn|mlp)\."
    r"(?P<module>[A-Za-z0-9_]+)\.lora_(?P<matrix>[AB])(?P<infix>\.[A-Za-z0-9_-]+)?\.weight"
)


# DoRA's magnitude of one projection, as PEFT (0.12 and later) saves it: no adapter-name infix, no ``.weight``.
MAGNITUDE_KEY = re.compile(
    r"(?P<prefix>(?:base_model\.model\.)?(?:model\.)?)layers\.(?P<layer>\d+)\.(?P<group>self_attn|mlp)\."
    r"(?P<module>[A-Za-z0-9_]+)\.lora_magnitude_vector"
)


# A trained LoRA bias (``lora_bias``): ``lora_B`` is a biased linear, saved with the weight's own infix.
BIAS_KEY = re.compile(
    r"(?P<prefix>(?:base_model\.model\.)?(?:model\.)?)layers\.(?P<layer>\d+)\.(?P<group>self_attn|mlp)\."
    r"(?P<module>[A-Za-z0-9_]+)\.lora_B(?P<infix>\.[A-Za-z0-9_-]+)?\.bias"
)


def bias_key_name(prefix: str, layer: int, module: str, infix: str) -> str:
    return f"{prefix}layers.{layer}.{GROUP[module]}.{module}.lora_B{infix}.bias"


def magnitude_key_name(prefix: str, layer: int, module: str) -> str:
    return f"{prefix}layers.{layer}.{GROUP[module]}.{module}.lora_magnitude_vector"


def parse_lora_key(name: str) -> LoraKey | None:
    """The parts of a LoRA weight name of a Llama projection, or None for any other name."""
    m = LORA_KEY.fullmatch(name)
    if m is None:
        return None
    prefix, layer, group, module, matrix, infix = m.groups()
    if GROUP.get(module) != group:
        return None
    return LoraKey(prefix, int(layer), module, matrix, infix or "")


def lora_key_name(key: LoraKey) -> str:
    return f"{key.prefix}layers.{key.layer}.{GROUP[key.module]}.{key.module}.lora_{key.matrix}{key.infix}.weight"


def explain_foreign_key(name: str) -> str:
    """Why a tensor name that is not a LoRA projection weight cannot be served."""
    if "lora_magnitude_vector" in name:
        return "a DoRA magnitude vector, but the adapter_config.json does not set use_dora (or its name is not PEFT's)"
    if "modules_to_save" in name:
        return "a modules_to_save copy under its wrapper's name (peft saves it as '<module>.weight', which is read)"
    if "lora_embedding_" in name or "embed_tokens" in name or "lm_head" in name:
        return (
            "not a name peft gives LoRA on the embeddings or the head (model.embed_tokens.lora_embedding_A / _B, "
            "lm_head.lora_A.weight / _B.weight) or a saved copy of them (<module>.weight, <module>.base_layer.weight)"
        )
    if ".lora_B" in name and name.endswith(".bias"):
        return "a trained LoRA bias, but the adapter_config.json does not set lora_bias"
    if name.endswith(".bias"):
        return "a base-layer bias: Llama's projections have none, so it cannot be served"
    return f"unexpected tensor: not a lora_A/lora_B weight of a Llama projection ({', '.join(MODULES)})"


__all__ = [
    "ATTENTION",
    "BIAS_KEY",
    "GROUP",
    "LORA_KEY",
    "MAGNITUDE_KEY",
    "LoraKey",
    "bias_key_name",
    "explain_foreign_key",
    "lora_key_name",
    "magnitude_key_name",
    "module_features",
    "module_key",
    "parse_lora_key",
]
