"""The model's shape and numerics, read from a Hugging Face ``config.json``.

Only plain Llama-family decoders are served: ``LlamaForCausalLM`` and ``MistralForCausalLM`` without a
sliding window shorter than the context. Anything else (other architectures, quantised checkpoints, activations
other than SiLU, RoPE types other than default / linear / llama3, partial rotary) is refused *by name* with a
``CheckpointError`` that points at the config file, before any weight is read.

Both spellings of the RoPE settings are understood: transformers 5 writes ``rope_parameters`` (with
``rope_theta`` inside), older checkpoints write ``rope_theta`` next to an optional ``rope_scaling`` dict whose
type key is ``rope_type`` or ``type``. If the folder holds a ``generation_config.json``, its end-of-sequence ids
are added to those of ``config.json``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.errors import CheckpointError
from service.hf_json import eos_token_ids, read_json_object

__all__ = [
    "DEFAULT_ROPE_THETA",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "FusedPart",
    "ModelConfig",
    "RopeScaling",
]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency rescaling. ``linear`` uses ``factor``; ``llama3`` uses all fields."""

    rope_type: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class FusedPart:
    """One Hugging Face projection stored as rows ``[start, stop)`` of a fused weight."""

    hf_name: str  # e.g. "q_proj", "gate_proj"
    start: int
    stop: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    architecture: str
    model_type: str

    def fused_rows(self) -> dict[str, tuple[FusedPart, ...]]:
        """Row layout of the fused weights: ``wqkv`` = [q; k; v], ``w13`` = [gate; up].

        The same layout applies to the fused biases and to the output columns of the fused projections, which
        is what a LoRA delta for ``q_proj`` etc. must be added to.
        """
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        i = self.intermediate_size
        return {
            "wqkv": (
                FusedPart("q_proj", 0, q),
                FusedPart("k_proj", q, q + kv),
                FusedPart("v_proj", q + kv, q + 2 * kv),
            ),
            "w13": (FusedPart("gate_proj", 0, i), FusedPart("up_proj", i, 2 * i)),
        }

    @classmethod
    def from_hf(cls, folder_or_config_json: Path) -> ModelConfig:
        """Parse a model folder (or its ``config.json``); refuse what this server cannot run, by name."""
        path = Path(folder_or_config_json)
        config_path = path / "config.json" if path.is_dir() else path
        raw = read_json_object(config_path)
        extra_eos: list[int] = []
        generation_path = config_path.parent / "generation_config.json"
        if generation_path.is_file():
            extra_eos = eos_token_ids(read_json_object(generation_path).get("eos_token_id"), generation_path)
        return cls.from_dict(raw, source=config_path, extra_eos_token_ids=extra_eos)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], *, source: Path | str = "config.json", extra_eos_token_ids: list[int] | None = None
    ) -> ModelConfig:
        def fail(message: str) -> CheckpointError:
            return CheckpointError(message, file=source)

        model_type = raw.get("model_type")
        architecture = _supported_architecture(raw, fail)

        def req_int(key: str) -> int:
            value = raw.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise fail(f"{key!r} must be a positive integer, got {value!r}")
            return value

        hidden = req_int("hidden_size")
        num_heads = req_int("num_attention_heads")
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        head_dim = raw.get("head_dim") or hidden // num_heads
        if not _is_positive_int(num_kv_heads) or num_heads % num_kv_heads != 0:
            raise fail(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads!r}")
        if not _is_positive_int(head_dim) or head_dim % 2 != 0:
            raise fail(f"head_dim must be an even positive integer, got {head_dim!r}")
        max_pos = req_int("max_position_embeddings")
        sliding = raw.get("sliding_window")
        if sliding is not None and (not isinstance(sliding, int) or sliding < max_pos):
            raise fail(
                f"sliding_window={sliding} is shorter than max_position_embeddings={max_pos}; "
                "sliding-window attention is not supported"
            )
        rope_theta, rope_scaling = _parse_rope(raw, fail)
        eos = eos_token_ids(raw.get("eos_token_id"), source)
        for token in extra_eos_token_ids or []:
            if token not in eos:
                eos.append(token)
        bos = raw.get("bos_token_id")
        eps = raw.get("rms_norm_eps", 1e-6)
        if not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise fail(f"rms_norm_eps must be a small positive number, got {eps!r}")
        return cls(
            vocab_size=req_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=req_int("intermediate_size"),
            num_layers=req_int("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=bos if isinstance(bos, int) else None,
            eos_token_ids=tuple(eos),
            architecture=architecture,
            model_type=str(model_type),
        )


def _supported_architecture(raw: dict[str, Any], fail: Callable[[str], CheckpointError]) -> str:
    """The checkpoint's one architecture, after checking that this server runs it (type, no quantization, SwiGLU)."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    if not architectures and model_type in SUPPORTED_MODEL_TYPES:  # some converters leave it out
        architectures = [SUPPORTED_ARCHITECTURES[SUPPORTED_MODEL_TYPES.index(model_type)]]
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise fail(f"expected exactly one entry in 'architectures', got {architectures!r}")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise fail(f"unsupported architecture {architecture!r}; this server runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise fail(f"unsupported model_type {model_type!r}; this server runs {', '.join(SUPPORTED_MODEL_TYPES)}")
    quantization = raw.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise fail(f"quantized checkpoints are not supported (quantization_config.quant_method={method!r})")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise fail(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
    return str(architecture)


def _parse_rope(raw: dict[str, Any], fail: Callable[[str], CheckpointError]) -> tuple[float, RopeScaling | None]:
    """Read ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (older files)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise fail(f"rope parameters must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise fail("per-layer-type rope_parameters are not supported")
    theta = _finite(params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise fail(f"partial_rotary_factor={partial} is not supported")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise fail(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if not (math.isfinite(theta) and theta > 0):
        raise fail(f"rope_theta must be positive, got {theta}")
    if rope_type == "default":
        return theta, None
    factor = _finite(params.get("factor"))
    if not factor > 0:
        raise fail(f"rope type {rope_type!r} needs a positive 'factor', got {params.get('factor')!r}")
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise fail(f"rope type 'llama3' needs {key!r}")
    low, high = _finite(params["low_freq_factor"]), _finite(params["high_freq_factor"])
    if not (math.isfinite(low) and math.isfinite(high)):
        raise fail("llama3 rope needs finite numeric low_freq_factor and high_freq_factor")
    # Phi-3 style files keep it at the top level; transformers gives that one priority, and so do we.
    original = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", raw.get("max_position_embeddings")
    )
    if not isinstance(original, int) or original <= 0:
        raise fail(f"llama3 rope needs a positive original_max_position_embeddings, got {original!r}")
    if high <= low:
        raise fail(f"llama3 rope needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    return theta, RopeScaling("llama3", factor, low, high, original)


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _finite(value: Any) -> float:
    """``value`` as a float, NaN when it is not a finite number (a string, null, bool, an int past float range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    try:
        number = float(value)
    except OverflowError:
        return math.nan
    return number if math.isfinite(number) else math.nan
