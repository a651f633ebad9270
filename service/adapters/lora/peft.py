"""The PEFT LoRA format: ``adapter_config.json``, which base modules it adapts, and with which rank and scaling.

Everything here is pure parsing and validation against the base model's shape; no tensor byte is read. The tensor
names of ``adapter_model.safetensors`` are taken apart in ``service.adapters.lora.peft_keys`` (re-exported here).

Matching follows PEFT 0.21 (``check_target_module_exists``, ``get_pattern_key``): a *list* of target modules
matches a module whose full name equals an entry or ends with ``"." + entry`` (then ``layers_to_transform`` /
``layers_pattern`` filter by layer index); a *string* is a regular expression that must match the full name
(and ``layers_to_transform`` does not apply). ``"all-linear"`` means every projection but ``lm_head``.
``rank_pattern`` / ``alpha_pattern`` keys are tried in file order, each as ``(.*\\.)?(key)$`` against the full
name; the first that matches wins. Full names are those of ``LlamaForCausalLM`` (``model.layers.{L}...``).
A regex that repeats a group which itself repeats or alternates (``(.*)*``, ``(a+)+``, ``(ab|a)*``) is refused at
parse time: ``re`` backtracks, and such a pattern can take hours to fail against one module name.

``fan_in_fan_out`` is accepted and ignored (PEFT resets it for ``nn.Linear`` targets; it never changes the stored
layout). Served beside plain LoRA: DoRA (``use_dora``: ``lora_magnitude_vector`` [out] per module), trained biases
(``lora_bias``; ``bias`` "lora_only" / "all" add nothing to Llama), LoRA on ``embed_tokens`` / ``lm_head`` and
``modules_to_save`` (``model_parts``). Refused by name: other PEFT types, DoRA with ``lora_bias`` (PEFT refuses it
too), ``ensure_weight_tying``, ``trainable_token_indices``, ``target_parameters``, ``layer_replication``, aLoRA,
QALoRA and the other LoRA variants whose forward differs from ``x @ A.T @ B.T * scaling``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.adapters.common.files import is_int, read_json_object, short_repr
from service.adapters.lora.patterns import regex_problem
from service.adapters.lora.peft_keys import (
    GROUP,
    LORA_KEY,
    LoraKey,
    explain_foreign_key,
    lora_key_name,
    module_features,
    module_key,
    parse_lora_key,
)
from service.adapters.lora.types import MODULES
from service.errors import InvalidAdapter
from service.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
CONVERT_HINT = (
    "loraplex reads only safetensors (pickled weights can run code when loaded). Convert once with peft: "
    "`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), ADAPTER_DIR)"
    ".save_pretrained(OUT_DIR, safe_serialization=True)`"
)

# PEFT's default targets when target_modules is null (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
DEFAULT_TARGETS = {"llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj")}
ALL_LINEAR = "all-linear"
Fail = Callable[[str], InvalidAdapter]  # builds the error naming the config file

# Config fields that turn on a feature loraplex does not serve: field -> what it is.
_REFUSED_TRUE = {"use_qalora": "QALoRA"}
_REFUSED_SET = {
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
}


@dataclass(frozen=True, slots=True)
class LoraAdapterConfig:
    """The fields of ``adapter_config.json`` that decide which modules get a delta and how it is scaled."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str  # list of suffixes, or one full-match regex
    exclude_modules: tuple[str, ...] | str | None
    use_rslora: bool
    rank_pattern: tuple[tuple[str, int], ...]  # in file order: the first matching key wins
    alpha_pattern: tuple[tuple[str, float], ...]
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    fan_in_fan_out: bool
    base_model_name_or_path: str | None
    use_dora: bool = False  # DoRA: each module's output rescaled per channel by lora_magnitude_vector / ||W + sBA||
    lora_bias: bool = False  # each lora_B has a trained bias [out], scaled like its weight
    modules_to_save: tuple[str, ...] = ()  # suffixes of modules saved whole (``model_parts.resolve_saved``)


def read_lora_config(path: Path, *, model_type: str = "llama") -> LoraAdapterConfig:
    """Parse and validate ``adapter_config.json``; every problem is an ``InvalidAdapter`` naming the file."""

    def fail(message: str) -> InvalidAdapter:
        return InvalidAdapter(message, file=path)

    raw = read_json_object(path, "file not found: a PEFT adapter folder needs adapter_config.json")
    _check_supported(raw, fail)
    r = _positive_int(raw.get("r", 8), "r", fail)
    alpha = _number(raw.get("lora_alpha", 8), "lora_alpha", fail)
    targets = _read_targets(raw, model_type, fail)
    exclude = _targets(raw.get("exclude_modules"), "exclude_modules", fail)
    layers_to_transform, layers_pattern = _read_layers(raw, fail)
    if isinstance(targets, str) and (layers_to_transform is not None or layers_pattern is not None):
        raise fail("layers_to_transform / layers_pattern cannot be used when target_modules is a regex string")
    rank_pattern = tuple(
        (k, _positive_int(v, f"rank_pattern[{k!r}]", fail)) for k, v in _pattern(raw, "rank_pattern", fail).items()
    )
    alpha_pattern = tuple(
        (k, _number(v, f"alpha_pattern[{k!r}]", fail)) for k, v in _pattern(raw, "alpha_pattern", fail).items()
    )
    base = raw.get("base_model_name_or_path")
    config = LoraAdapterConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        exclude_modules=exclude,
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        layers_to_transform=layers_to_transform,
        layers_pattern=layers_pattern,
        fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
        base_model_name_or_path=base if isinstance(base, str) else None,
        use_dora=bool(raw.get("use_dora", False)),
        lora_bias=bool(raw.get("lora_bias", False)),
        modules_to_save=_saved_names(raw.get("modules_to_save"), fail),
    )
    _check_regexes(config, fail)
    return config


def _check_supported(raw: Mapping[str, Any], fail: Fail) -> None:
    """Refuse, by name, a PEFT type other than LoRA and the features loraplex does not serve."""
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"peft_type {peft_type!r} is not supported; loraplex serves LoRA adapters (peft_type 'LORA')")
    for key, what in _REFUSED_TRUE.items():
        if raw.get(key):
            raise fail(f"{what} is not supported ({key}={raw[key]!r})")
    for key, what in _REFUSED_SET.items():
        if raw.get(key) not in (None, [], {}, ""):
            raise fail(f"{what} is not supported ({key}={raw[key]!r})")
    bias = raw.get("bias", "none")
    if bias not in ("none", "lora_only", "all"):
        raise fail(f"bias must be 'none', 'lora_only' or 'all', got {short_repr(bias)}")
    if raw.get("ensure_weight_tying"):
        raise fail("ensure_weight_tying (one adapter tensor shared by embed_tokens and lm_head) is not supported")
    if raw.get("lora_bias") and raw.get("use_dora"):
        raise fail("DoRA with a trained LoRA bias (use_dora and lora_bias) is not supported (peft refuses it too)")


def _read_targets(raw: Mapping[str, Any], model_type: str, fail: Fail) -> tuple[str, ...] | str:
    """``target_modules`` with PEFT's defaults applied (null: the model type's default; ``all-linear``)."""
    targets = _targets(raw.get("target_modules"), "target_modules", fail)
    if targets is None:
        if model_type not in DEFAULT_TARGETS:
            raise fail(f"target_modules is null and peft has no default targets for model_type {model_type!r}")
        return DEFAULT_TARGETS[model_type]
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        return MODULES
    return targets


def _read_layers(raw: Mapping[str, Any], fail: Fail) -> tuple[tuple[int, ...] | None, tuple[str, ...] | None]:
    """``layers_to_transform`` and ``layers_pattern``, each normalised to a tuple (None: not given)."""
    layers = raw.get("layers_to_transform")
    layers_to_transform: tuple[int, ...] | None
    if layers is None or layers == []:
        layers_to_transform = None
    elif is_int(layers):
        layers_to_transform = (int(layers),)
    elif isinstance(layers, list) and all(is_int(v) for v in layers):
        layers_to_transform = tuple(int(v) for v in layers)
    else:
        raise fail(f"layers_to_transform must be an integer or a list of integers, got {short_repr(layers)}")
    pattern = raw.get("layers_pattern")
    layers_pattern: tuple[str, ...] | None
    if pattern is None or pattern in ("", []):
        layers_pattern = None
    elif isinstance(pattern, str):
        layers_pattern = (pattern,)
    elif isinstance(pattern, list) and all(isinstance(p, str) for p in pattern):
        layers_pattern = tuple(pattern)
    else:
        raise fail(f"layers_pattern must be a string or a list of strings, got {short_repr(pattern)}")
    return layers_to_transform, layers_pattern


def _check_regexes(config: LoraAdapterConfig, fail: Fail) -> None:
    """Refuse every regex the config makes (as ``resolve_targets`` will use it) that could backtrack for hours."""
    for name, entries in (("target_modules", config.target_modules), ("exclude_modules", config.exclude_modules)):
        if isinstance(entries, str):
            _compile(entries, name, fail)
    patterns: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = (
        ("rank_pattern", config.rank_pattern),
        ("alpha_pattern", config.alpha_pattern),
    )
    for name, keys in patterns:
        for key, _ in keys:
            _compile(rf"(.*\.)?({key})$", f"{name} key {short_repr(key)}", fail)
    for p in config.layers_pattern or ():
        _compile(_layers_regex(p), f"layers_pattern {short_repr(p)}", fail)


def base_module_names(model_config: ModelConfig) -> list[str]:
    """Every module name of ``LlamaForCausalLM`` that a target pattern could match (``named_modules``)."""
    return list(_module_names(model_config.num_layers))


@functools.lru_cache(maxsize=8)
def _module_names(num_layers: int) -> tuple[str, ...]:
    names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        names += [prefix, f"{prefix}.self_attn", f"{prefix}.mlp", f"{prefix}.mlp.act_fn"]
        names += [f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm"]
        names += [module_key(layer, m) for m in MODULES]
    return tuple(names)


@functools.lru_cache(maxsize=8)
def _projections(num_layers: int) -> dict[str, tuple[int, str]]:
    return {module_key(layer, m): (layer, m) for layer in range(num_layers) for m in MODULES}


def _saved_names(value: Any, fail: Fail) -> tuple[str, ...]:
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise fail(f"modules_to_save must be a list of module names, got {short_repr(value)}")
    return tuple(dict.fromkeys(value))


def resolve_targets(
    config: LoraAdapterConfig, model_config: ModelConfig, *, file: Path
) -> dict[tuple[int, str], tuple[int, float]]:
    """Which modules the config adapts, each with its ``(rank, alpha)`` after rank/alpha patterns: the projections
    as ``(layer, module)``, ``model.embed_tokens`` / ``lm_head`` as ``(num_layers, name)`` (the pseudo-layer).

    Refuses (naming the entry) a target that matches no module of the base model, and a target that matches
    a module loraplex cannot adapt (norms, whole blocks).
    """
    names = _module_names(model_config.num_layers)
    top = model_config.num_layers  # the pseudo-layer of the model-level targets
    projections = {**_projections(top), "model.embed_tokens": (top, "embed_tokens"), "lm_head": (top, "lm_head")}

    targets = config.target_modules
    if isinstance(targets, str):
        regex = re.compile(targets)
        matched = [n for n in names if regex.fullmatch(n)]
        if not matched:
            raise InvalidAdapter(f"target_modules regex {targets!r} matches no module of the base model", file=file)
    else:
        matched = []
        for entry in targets:
            if entry in GROUP:  # the common case, a projection's own name: no scan needed
                hits = [module_key(layer, entry) for layer in range(model_config.num_layers)]
            else:
                hits = [n for n in names if n == entry or n.endswith(f".{entry}")]
            if not hits:
                raise InvalidAdapter(
                    f"target module {entry!r} not found in the base model (Llama projections: {', '.join(MODULES)})",
                    file=file,
                )
            matched += hits
    unsupported = sorted({n for n in matched if n not in projections}, key=names.index)
    if unsupported:
        shown = ", ".join(repr(n) for n in unsupported[:5]) + (" ..." if len(unsupported) > 5 else "")
        raise InvalidAdapter(
            f"target_modules selects module(s) loraplex cannot adapt: {shown}; supported: "
            f"{', '.join(MODULES)}, embed_tokens, lm_head",
            file=file,
        )

    out: dict[tuple[int, str], tuple[int, float]] = {}
    for name in dict.fromkeys(matched):
        if _excluded(config.exclude_modules, name) or not _layer_selected(config, name):
            continue
        rank = _pattern_value(config.rank_pattern, name, config.r)
        alpha = _pattern_value(config.alpha_pattern, name, config.lora_alpha)
        out[projections[name]] = (rank, alpha)
    return out


def lora_scaling(rank: int, alpha: float, rslora: bool) -> float:
    """PEFT's ``scaling``: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


# --- helpers ------------------------------------------------------------------------------------------------


def _positive_int(value: Any, what: str, fail: Fail) -> int:
    if not is_int(value) or value <= 0:
        raise fail(f"{what} must be a positive integer (the LoRA rank), got {short_repr(value)}")
    return int(value)


def _number(value: Any, what: str, fail: Fail) -> float:
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an integer beyond the float range stays NaN: refused
            number = float(value)
    if not math.isfinite(number):
        raise fail(f"{what} must be a finite number, got {short_repr(value)}")
    return number


def _targets(value: Any, what: str, fail: Fail) -> tuple[str, ...] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(dict.fromkeys(value))
    raise fail(f"{what} must be a list of module names or a regex string, got {short_repr(value)}")


def _pattern(raw: Mapping[str, Any], key: str, fail: Fail) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(f"{key} must map module patterns to values, got {short_repr(value)}")
    return value


def _compile(pattern: str, what: str, fail: Fail) -> None:
    problem = regex_problem(pattern)
    if problem is not None:
        raise fail(f"{what} ({short_repr(pattern)}) {problem}")


def _layers_regex(layers_pattern: str) -> str:
    """The name of a layer under ``layers_pattern`` (grouped, so an alternation cannot bypass the index)."""
    return rf"(?:^|.*?\.)(?:{layers_pattern})\.(?P<idx>\d+)\."


def _excluded(exclude: tuple[str, ...] | str | None, name: str) -> bool:
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, name) is not None
    return name in exclude or any(name.endswith(f".{e}") for e in exclude)


def _layer_selected(config: LoraAdapterConfig, name: str) -> bool:
    if config.layers_to_transform is None or isinstance(config.target_modules, str):
        return True
    match: re.Match[str] | None = None
    if config.layers_pattern is None:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        for pattern in config.layers_pattern:
            match = re.match(_layers_regex(pattern), name)
            if match is not None:
                break
    return match is not None and int(match["idx"]) in config.layers_to_transform


def _pattern_value(pattern: Iterable[tuple[str, Any]], name: str, default: Any) -> Any:
    for key, value in pattern:
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


__all__ = [
    "ALL_LINEAR",
    "CONFIG_FILE",
    "CONVERT_HINT",
    "DEFAULT_TARGETS",
    "GROUP",
    "LORA_KEY",
    "MODULES",
    "PICKLE_FILES",
    "WEIGHTS_FILE",
    "LoraAdapterConfig",
    "LoraKey",
    "base_module_names",
    "explain_foreign_key",
    "lora_key_name",
    "lora_scaling",
    "module_features",
    "module_key",
    "parse_lora_key",
    "read_lora_config",
    "resolve_targets",
]
