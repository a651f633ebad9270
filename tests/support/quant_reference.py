"""The dequantized reference of a quantized model: the same weights, in float32, written back to a real HF folder.

    write_dequantized(src, model, dst) -> Path

``dst`` gets ``src``'s config and tokenizer files and one ``model.safetensors`` holding every tensor of ``src``, with
each projection replaced by ``model``'s own quantized weight, dequantized to float32 and split back into the HF
tensors it was fused from (q/k/v, gate/up). transformers (or ``peft`` on top of it) loading ``dst`` is then the
reference implementation of exactly the weights the quantized model serves.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from service.model import Llama
from service.model.llama import PROJ_NAMES
from service.model.load_folder import projection_parts

# The tiny Llamas the quantized paths are checked on: (tiny Llama config overrides).
VARIANTS: dict[str, dict[str, Any]] = {
    "gqa": {},
    "mha_bias_tied": {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
}


def load_quantized(kind: str, variant: str, tiny_llama_factory: Callable[..., Path]) -> Llama:
    """`VARIANTS` ``variant`` (from the ``tiny_llama_factory`` fixture) quantized to ``kind`` ("int8" / "int4")."""
    from support.tiny_models import load_ours

    folder = tiny_llama_factory(seed=11 + len(variant), **VARIANTS[variant])
    return load_ours(folder, quantize=kind)  # type: ignore[no-any-return]


def quantized_and_reference(
    kind: str, variant: str, tiny_llama_factory: Callable[..., Path], tmp: Path
) -> tuple[Llama, Any]:
    """`load_quantized` and transformers on its very weights dequantized (`write_dequantized` into ``tmp``)."""
    from support.tiny_models import load_hf_llama

    ours = load_quantized(kind, variant, tiny_llama_factory)
    folder = tiny_llama_factory(seed=11 + len(variant), **VARIANTS[variant])
    return ours, load_hf_llama(write_dequantized(folder, ours, tmp))


def write_dequantized(src: Path, model: Llama, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    for i in range(model.cfg.num_layers):
        for name in PROJ_NAMES:
            weight = model.projection(i, name)
            dense = weight.dequantize(torch.float32) if not isinstance(weight, torch.Tensor) else weight.float()
            for hf, rows in projection_parts(model.cfg, i, name):
                tensors[f"{hf}.weight"] = (dense if rows is None else dense[rows]).contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and not file.name.endswith(".index.json"):
            shutil.copy(file, dst / file.name)
    return dst
