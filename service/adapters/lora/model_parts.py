"""Adapter tensors beside the projections' LoRA: LoRA on ``embed_tokens`` / ``lm_head`` and ``modules_to_save``.

Names as PEFT 0.21 saves them (``base_model.model.`` in front, optional in older files):

- LoRA on the embedding: ``model.embed_tokens.lora_embedding_A`` [r, vocab] and ``..._B`` [hidden, r] (no
  ``.weight``); on the head: ``lm_head.lora_A.weight`` [r, hidden] and ``lm_head.lora_B.weight`` [vocab, r]. Both
  are scaled like a projection's (``lora_alpha / r``, rank / alpha patterns matched on ``model.embed_tokens`` and
  ``lm_head``). PEFT's default ``save_embedding_layers="auto"`` also writes the targeted layer's own weight
  (``embed_tokens.base_layer.weight``, ``lm_head.base_layer.weight``), which PEFT loads over the base's: served as
  that module's replacement, like a saved module.
- ``modules_to_save`` entries are matched as PEFT does, by plain suffix of the module name (``"norm"`` selects every
  norm); a norm (``model.layers.{L}.input_layernorm`` / ``post_attention_layernorm``, ``model.norm``), the embedding
  and the head can be saved, each stored under its own name plus ``.weight``. Anything else a suffix selects (a
  projection, a whole block) is refused by name, as is a module both saved and LoRA-targeted.

A saved module replaces the base weight for the adapter's rows only; its bytes (in the serving dtype) are counted in
the tiers and bounded per adapter by the store (``--max-saved-module-bytes``). Pure parsing: no tensor byte is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from service.adapters.lora.peft import CONFIG_FILE, LoraAdapterConfig, base_module_names, lora_scaling
from service.adapters.lora.spec import FLOAT_CODES, PartRecord
from service.adapters.lora.types import LAYER_NORMS, MODEL_MODULES
from service.errors import InvalidAdapter
from service.loading import TensorRecord
from service.model.config import ModelConfig

_OUTER = "base_model.model."
_KEYS = (  # (regex on the name without _OUTER, role); the groups name the part
    (re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<name>input_layernorm|post_attention_layernorm)\.weight"), "saved"),
    (re.compile(r"model\.(?P<name>norm)\.weight"), "saved"),
    (re.compile(r"(?:model\.)?(?P<name>embed_tokens|lm_head)\.weight"), "saved"),
    (re.compile(r"(?:model\.)?(?P<name>embed_tokens|lm_head)\.base_layer\.weight"), "base"),
    (re.compile(r"model\.(?P<name>embed_tokens)\.lora_embedding_(?P<role>[AB])(?:\.[A-Za-z0-9_-]+)?"), "lora"),
    (re.compile(r"(?P<name>lm_head)\.lora_(?P<role>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight"), "lora"),
)


def parse_part_key(name: str, num_layers: int) -> tuple[int, str, str] | None:
    """``(layer, part, role)`` of a part's tensor name (role "A", "B", "saved" or "base"), or None."""
    rest = name[len(_OUTER) :] if name.startswith(_OUTER) else name
    for regex, role in _KEYS:
        m = regex.fullmatch(rest)
        if m is not None:
            groups = m.groupdict()
            layer = int(groups["layer"]) if groups.get("layer") is not None else num_layers
            return layer, m["name"], groups.get("role") or role
    return None


def resolve_saved(config: LoraAdapterConfig, model_config: ModelConfig, *, file: Path) -> set[tuple[int, str]]:
    """The ``(layer, part)`` of every module ``modules_to_save`` selects (see the module docstring)."""
    top = model_config.num_layers
    names = base_module_names(model_config)
    saved: set[tuple[int, str]] = set()
    for entry in config.modules_to_save:
        hits = [n for n in names if n.endswith(entry)]
        if not hits:
            raise InvalidAdapter(f"modules_to_save entry {entry!r} matches no module of the base model", file=file)
        for hit in hits:
            part = _savable(hit, top)
            if part is None:
                raise InvalidAdapter(
                    f"modules_to_save entry {entry!r} selects {hit!r}, which loraplex cannot replace (it serves "
                    "saved norms, embed_tokens and lm_head)",
                    file=file,
                )
            saved.add(part)
    return saved


def _savable(module: str, top: int) -> tuple[int, str] | None:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)", module)
    if m is not None:
        return int(m[1]), m[2]
    return {"model.norm": (top, "norm"), "model.embed_tokens": (top, "embed_tokens"), "lm_head": (top, "lm_head")}.get(
        module
    )


def index_parts(
    found: Iterable[tuple[tuple[int, str, str], TensorRecord]],
    lora: Mapping[tuple[int, str], tuple[int, float]],
    saved: set[tuple[int, str]],
    config: LoraAdapterConfig,
    model_config: ModelConfig,
    problems: list[tuple[str, str]],
) -> tuple[PartRecord, ...]:
    """Check the part tensors ``found`` (parsed names, records) against the LoRA targets ``lora`` (pseudo-layer
    entries of ``resolve_targets``) and the ``saved`` modules; problems go to ``problems``."""
    top, vocab, hidden = model_config.num_layers, model_config.vocab_size, model_config.hidden_size
    both = sorted(name for layer, name in saved if (layer, name) in lora)
    if both:
        problems.append(("", f"{', '.join(both)} is both a LoRA target and in modules_to_save"))
    seen: dict[tuple[int, str, str], TensorRecord] = {}
    for (layer, name, role), rec in found:
        key = (layer, name, "saved" if role == "base" else role)
        if layer >= top and name in LAYER_NORMS:
            problems.append((rec.name, f"layer {layer} is outside the base model's {top} layers"))
        elif role == "saved" and (layer, name) not in saved:
            problems.append((rec.name, f"a saved {name}, but {CONFIG_FILE} does not list it in modules_to_save"))
        elif role == "base" and (layer, name) not in lora:
            problems.append((rec.name, f"{name}'s base_layer weight, but {CONFIG_FILE} does not target {name}"))
        elif role in "AB" and (layer, name) not in lora:
            problems.append((rec.name, f"{CONFIG_FILE} does not target {name}"))
        elif key in seen:
            problems.append((rec.name, f"a second tensor for {name} (first: {seen[key].name!r})"))
        else:
            seen[key] = rec
    out: list[PartRecord] = []
    for (layer, name), (rank, alpha) in sorted(lora.items()):
        a, b = seen.get((layer, name, "A")), seen.get((layer, name, "B"))
        if a is None or b is None:
            problems.append(("", f"{CONFIG_FILE} targets {name}, but the file has no lora_{'A' if a is None else 'B'}"))
            continue
        fin, fout = (vocab, hidden) if name == "embed_tokens" else (hidden, vocab)
        bad = _shape(a, (rank, fin), f"[r, {fin}] with r={rank}") or _shape(b, (fout, rank), f"[{fout}, r={rank}]")
        if bad is not None:
            problems.append(bad)
            continue
        scaling = lora_scaling(rank, alpha, config.use_rslora)
        out += [PartRecord(layer, name, "A", a), PartRecord(layer, name, "B", b, scaling)]
    for layer, name in sorted(saved | {(la, n) for la, n, role in seen if role == "saved"}):
        weight = seen.get((layer, name, "saved"))
        if weight is None:
            problems.append(("", f"modules_to_save lists {_full_name(layer, name, top)}, but the file has no tensor"))
            continue
        shape = (hidden,) if name in (*LAYER_NORMS, "norm") else (vocab, hidden)
        what = f"{list(shape)}" + (" (a resized vocabulary is not supported)" if name in MODEL_MODULES else "")
        bad = _shape(weight, shape, what)
        if bad is not None:
            problems.append(bad)
            continue
        out.append(PartRecord(layer, name, "saved", weight))
    return tuple(out)


def _shape(rec: TensorRecord, shape: tuple[int, ...], what: str) -> tuple[str, str] | None:
    if rec.dtype not in FLOAT_CODES:
        return rec.name, f"dtype {rec.dtype} is not a float type ({', '.join(FLOAT_CODES)})"
    if tuple(rec.shape) != shape:
        return rec.name, f"shape {list(rec.shape)}: expected {what}"
    return None


def _full_name(layer: int, name: str, top: int) -> str:
    if layer < top:
        return f"model.layers.{layer}.{name}"
    return "lm_head" if name == "lm_head" else f"model.{name}"


__all__ = ["index_parts", "parse_part_key", "resolve_saved"]
