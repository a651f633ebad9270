"""ModelConfig.from_hf: what is accepted, what is refused by name, and RoPE frequencies equal to transformers'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.tiny_models import tiny_llama_config

from service.errors import CheckpointError
from service.model.config import ModelConfig, RopeScaling
from service.model.rope import rope_inv_freq

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "eos_token_id": 2,
}


def _write(tmp_path: Path, **changes: Any) -> Path:
    raw = {**BASE, **changes}
    raw = {k: v for k, v in raw.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_parses_the_tiny_folder(tiny_llama_dir: Path) -> None:
    cfg = ModelConfig.from_hf(tiny_llama_dir)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (4, 2, 16, 2)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert ModelConfig.from_hf(tiny_llama_dir / "config.json") == cfg


def test_head_dim_defaults_and_eos_from_generation_config(tmp_path: Path) -> None:
    folder = _write(tmp_path, eos_token_id=[2, 5])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    cfg = ModelConfig.from_hf(folder)
    assert cfg.head_dim == 16
    assert cfg.eos_token_ids == (2, 5, 7)
    fused = cfg.fused_rows()
    assert [(p.hf_name, p.start, p.stop) for p in fused["wqkv"]] == [
        ("q_proj", 0, 64),
        ("k_proj", 64, 96),
        ("v_proj", 96, 128),
    ]
    assert [(p.hf_name, p.start, p.stop) for p in fused["w13"]] == [("gate_proj", 0, 96), ("up_proj", 96, 192)]


def test_mistral_without_short_window_is_accepted(tmp_path: Path) -> None:
    cfg = ModelConfig.from_hf(
        _write(tmp_path, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    )
    assert cfg.architecture == "MistralForCausalLM"


def test_missing_architectures_follow_model_type(tmp_path: Path) -> None:
    assert ModelConfig.from_hf(_write(tmp_path, architectures=None)).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"model_type": "qwen2"}, "qwen2"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "factor"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "low_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 128}, "sliding_window"),
        ({"quantization_config": {"quant_method": "gptq"}}, "gptq"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": None}, "hidden_size"),
        ({"rms_norm_eps": "tiny"}, "rms_norm_eps"),
        ({"architectures": None, "model_type": "gpt_neox"}, "architectures"),
    ],
)
def test_unsupported_is_refused_by_name(tmp_path: Path, changes: dict[str, Any], named: str) -> None:
    folder = _write(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=named) as err:
        ModelConfig.from_hf(folder)
    assert err.value.file == str(folder / "config.json")


def test_missing_or_broken_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(CheckpointError, match="JSON"):
        ModelConfig.from_hf(tmp_path)


ROPE_CASES: dict[str, dict[str, Any]] = {
    "default": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5}},
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "head_dim": 128,
        "hidden_size": 512,
    },
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("legacy", [False, True], ids=["rope_parameters", "rope_scaling"])
def test_rope_frequencies_equal_transformers(tmp_path: Path, case: str, legacy: bool) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = tiny_llama_config(**ROPE_CASES[case])
    raw = hf_config.to_dict()
    if legacy:  # the pre-transformers-5 spelling of the same settings
        params = dict(raw.pop("rope_parameters"))
        raw["rope_theta"] = params.pop("rope_theta")
        kind = params.pop("rope_type")
        if kind != "default":
            raw["rope_scaling"] = {"type": kind, **params}
    raw["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_hf(tmp_path)
    assert (cfg.rope_scaling.rope_type if cfg.rope_scaling else "default") == case
    expected = LlamaRotaryEmbedding(hf_config).inv_freq
    assert torch.equal(rope_inv_freq(cfg), expected)


def test_llama3_original_length_defaults_to_max_positions(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cfg = ModelConfig.from_hf(_write(tmp_path, rope_scaling=scaling, rope_theta=5e5))
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 512)
    assert cfg.rope_theta == 5e5


@pytest.mark.slow
def test_smollm2_config(smollm2_dir: Path) -> None:
    cfg = ModelConfig.from_hf(smollm2_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert 2 in cfg.eos_token_ids
