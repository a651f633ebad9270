"""Real PEFT LoRA adapters for tests, written by ``peft`` itself (``get_peft_model`` + ``save_pretrained``).

    write_peft_adapter(folder, base, *, r=8, alpha=16, target_modules=("q_proj", "v_proj"), rslora=False,
                       rank_pattern=None, alpha_pattern=None, layers_to_transform=None, layers_pattern=None,
                       seed=0, scale=1.0, dtype=torch.float32, infix=None, **lora_kwargs) -> Path
    load_peft_model(base, adapter_dirs: Mapping[str, Path]) -> peft.PeftModel   (fp32, eval, the reference)
    edit_adapter_config(folder, **changes) -> None
    rewrite_adapter_tensors(folder, edit: Callable[[dict[str, Tensor]], dict[str, Tensor]]) -> None
    peft_lora_layers(folder, *, dtype=torch.float32) -> dict[int, LoraLayer]   (read by hand: the reference)
    lookup_for(adapters: Mapping[str, Mapping[int, LoraLayer]]) -> Callable[[str, int], LoraLayer | None]

``base`` is a base-model folder (e.g. ``tiny_models.write_tiny_llama``) or an already loaded transformers model,
which is wrapped, saved from and restored with ``unload()``, so one loaded SmolLM2 can produce many adapters.
Both ``lora_A`` and ``lora_B`` are drawn from a seeded normal distribution (PEFT would start ``lora_B`` at zero,
which makes every adapter a no-op); ``scale`` sets the size of the delta relative to the base projection's
output. ``infix="default"`` renames keys to the older ``lora_A.default.weight`` spelling.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from service.adapters.lora.types import LoraLayer, LoraModule

KEY = re.compile(r"base_model\.model\.(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")


def _load_base(base: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def write_peft_adapter(
    folder: Path,
    base: Path | Any,
    *,
    r: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] | str = ("q_proj", "v_proj"),
    rslora: bool = False,
    rank_pattern: Mapping[str, int] | None = None,
    alpha_pattern: Mapping[str, float] | None = None,
    layers_to_transform: int | Sequence[int] | None = None,
    layers_pattern: str | None = None,
    seed: int = 0,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    infix: str | None = None,
    **lora_kwargs: Any,
) -> Path:
    """Wrap ``base`` with a LoRA config, fill the adapter with seeded random weights, ``save_pretrained``."""
    from peft import LoraConfig, get_peft_model

    folder = Path(folder)
    model = _load_base(Path(base)) if isinstance(base, (str, Path)) else base
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        use_rslora=rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        layers_to_transform=list(layers_to_transform)
        if isinstance(layers_to_transform, Sequence)
        else layers_to_transform,
        layers_pattern=layers_pattern,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        **lora_kwargs,
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name:  # [r, in]: unit-variance x @ A.T
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif ".lora_B." in name:  # [out, r]
                param.copy_(scale * torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_magnitude_vector" in name:
                param.mul_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
        if dtype != torch.float32:
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.data = param.data.to(dtype)
    peft_model.save_pretrained(folder, safe_serialization=True)
    peft_model.unload()  # give a caller's model back without LoRA layers
    if infix is not None:
        rewrite_adapter_tensors(
            folder,
            lambda tensors: {k.replace(".weight", f".{infix}.weight"): v for k, v in tensors.items()},
        )
    return folder


def write_peft_adapters(
    root: Path, base: Path | Any, specs: Mapping[str, Mapping[str, Any]], **common: Any
) -> dict[str, Path]:
    """One `write_peft_adapter` folder per ``name: keywords`` of ``specs`` under ``root`` (each also with
    ``common``), over the same ``base``: ``{name: folder}``."""
    return {name: write_peft_adapter(root / name, base, **common, **kw) for name, kw in specs.items()}


def load_peft_model(base: Path | Any, adapter_dirs: Mapping[str, Path]) -> Any:
    """The reference: transformers' Llama with each adapter loaded by peft under its key as adapter name."""
    from peft import PeftModel

    model = _load_base(Path(base)) if isinstance(base, (str, Path)) else base
    items = list(adapter_dirs.items())
    name, first = items[0]
    peft_model = PeftModel.from_pretrained(model, first, adapter_name=name)
    for name, folder in items[1:]:
        peft_model.load_adapter(folder, adapter_name=name)
    return peft_model.eval()


def reference_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Exactly ``new_tokens`` greedy tokens from a transformers/peft model (no end-of-sequence stop)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def edit_adapter_config(folder: Path, **changes: Any) -> None:
    """Rewrite keys of ``adapter_config.json`` (None deletes a key)."""
    path = Path(folder) / "adapter_config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw, indent=2))


def rewrite_adapter_tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Load ``adapter_model.safetensors``, apply ``edit`` to the name -> tensor map, save it back."""
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "adapter_model.safetensors"
    tensors = edit(load_file(path))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})


def peft_lora_layers(folder: Path, *, dtype: torch.dtype = torch.float32) -> dict[int, LoraLayer]:
    """layer -> LoraLayer from a PEFT folder: B scaled by alpha/r (alpha/sqrt(r) with rsLoRA), patterns applied."""
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(folder / "adapter_model.safetensors")
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.match(key)
        assert match is not None, key
        full, layer, module, side = match.groups()
        pairs.setdefault((int(layer), module, full), {})[side] = tensor
    layers: dict[int, dict[str, LoraModule]] = {}
    for (layer, module, full), ab in pairs.items():
        rank = ab["A"].shape[0]
        alpha = config["lora_alpha"]
        for pattern, value in config.get("alpha_pattern", {}).items():  # peft's get_pattern_key: first match
            if re.match(rf"(.*\.)?({pattern})$", full):
                alpha = value
                break
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        layers.setdefault(layer, {})[module] = LoraModule(a=ab["A"].to(dtype), b=(ab["B"] * scaling).to(dtype))
    return {
        layer: LoraLayer(modules, sum(m.a.nbytes + m.b.nbytes for m in modules.values()))
        for layer, modules in layers.items()
    }


def lookup_for(adapters: Mapping[str, Mapping[int, LoraLayer]]) -> Callable[[str, int], LoraLayer | None]:
    def lookup(adapter_id: str, layer: int) -> LoraLayer | None:
        return adapters[adapter_id].get(layer)

    return lookup
