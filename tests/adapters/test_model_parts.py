"""Registration and loading of the adapter tensors beside the projections' LoRA, as peft writes them: LoRA on
embed_tokens / lm_head (with the base-layer copies peft's default ``save_embedding_layers="auto"`` adds) and
``modules_to_save``. The index points at exactly the tensors peft saved; every bad one is refused by name before a
byte is read; the saved modules are counted in the tiers and bounded by ``--max-saved-module-bytes``.
(Exactness against peft's forward: ``test_peft_exact_variants``.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.adapter_files import edit_adapter_config, rewrite_adapter_tensors, write_peft_adapter

from service.adapters.common.files import NonFiniteTensor
from service.adapters.lora.mix import compose_layer
from service.adapters.lora.registry import index_adapter
from service.adapters.lora.store import AdapterStore
from service.adapters.lora.types import LoraLayer
from service.errors import InvalidAdapter, InvalidRequest, ResourceExhausted
from service.model.config import ModelConfig

EMBED_A = "base_model.model.model.embed_tokens.lora_embedding_A"
EMBED_BASE = "base_model.model.model.embed_tokens.base_layer.weight"
NORM = "base_model.model.model.norm.weight"
LAYER1_NORM = "base_model.model.model.layers.1.post_attention_layernorm.weight"


@pytest.fixture(scope="module")
def cfg(tiny_llama_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(tiny_llama_dir)


@pytest.fixture(scope="module")
def base_model(tiny_llama_dir: Path) -> Any:
    from support.tiny_models import load_hf_llama

    return load_hf_llama(tiny_llama_dir)


@pytest.fixture
def embed_head(base_model: Any, tmp_path: Path) -> Path:
    """LoRA on q_proj, embed_tokens and lm_head, saved by peft with its defaults (the base layers copied)."""
    return write_peft_adapter(tmp_path / "eh", base_model, r=4, target_modules=("q_proj", "embed_tokens", "lm_head"))


@pytest.fixture
def saved(base_model: Any, tmp_path: Path) -> Path:
    """modules_to_save every norm ("norm" is a suffix of all of them, as peft matches it) and lm_head."""
    return write_peft_adapter(tmp_path / "mts", base_model, r=4, modules_to_save=["norm", "lm_head"])


def _store(cfg: ModelConfig, **kw: Any) -> AdapterStore:
    return AdapterStore(
        cfg, device=torch.device("cpu"), dtype=torch.float32, device_budget_bytes=1 << 26, host_budget_bytes=1 << 26,
        **kw,
    )  # fmt: skip


def test_embed_and_head_lora_index_the_tensors_peft_saved(embed_head: Path, cfg: ModelConfig) -> None:
    spec = index_adapter("eh", embed_head, cfg)
    tensors = load_file(embed_head / "adapter_model.safetensors")
    roles = {(p.name, p.role): p for p in spec.parts}
    assert set(roles) == {(n, r) for n in ("embed_tokens", "lm_head") for r in ("A", "B", "saved")}
    for p in spec.parts:
        assert p.layer == cfg.num_layers and tuple(tensors[p.record.name].shape) == p.record.shape
    assert roles[("embed_tokens", "A")].record.name == EMBED_A
    assert roles[("embed_tokens", "saved")].record.name == EMBED_BASE  # the base-layer copy replaces the base's
    assert roles[("lm_head", "B")].scaling == 16 / 4 and roles[("lm_head", "A")].scaling == 1.0  # alpha 16, r 4
    assert spec.module_ranks() == {"q_proj": 4, "embed_tokens": 4, "lm_head": 4}
    assert spec.saved_modules == ("embed_tokens", "lm_head")
    assert spec.extras_nbytes(None) == sum(t.nbytes for k, t in tensors.items() if "layers." not in k)


def test_modules_to_save_match_by_suffix_as_peft_does(saved: Path, cfg: ModelConfig) -> None:
    spec = index_adapter("mts", saved, cfg)
    got = {(p.layer, p.name) for p in spec.parts}
    layers = {(la, n) for la in range(cfg.num_layers) for n in ("input_layernorm", "post_attention_layernorm")}
    assert got == layers | {(cfg.num_layers, "norm"), (cfg.num_layers, "lm_head")}
    assert all(p.role == "saved" for p in spec.parts)
    assert spec.saved_modules == ("input_layernorm", "post_attention_layernorm", "norm", "lm_head")


def _vocab_cut(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v[:-1] if k == EMBED_BASE else v for k, v in t.items()}


PART_EDITS: list[tuple[str, Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], str, str | None]] = [
    ("embed_head", _vocab_cut, "a resized vocabulary is not supported", EMBED_BASE),
    ("embed_head", lambda t: {k: v[:2] if k == EMBED_A else v for k, v in t.items()}, r"expected \[r, ", EMBED_A),
    ("embed_head", lambda t: {k: v.int() if k == EMBED_A else v for k, v in t.items()}, "not a float type", EMBED_A),
    ("embed_head", lambda t: {k: v for k, v in t.items() if k != EMBED_A}, "has no lora_A", None),
    ("embed_head", lambda t: {**t, NORM: torch.ones(64)}, "does not list it in modules_to_save", NORM),
    ("saved", lambda t: {k: v for k, v in t.items() if k != LAYER1_NORM}, "layers.1.post_attention_layernorm", None),
    ("saved", lambda t: {k: v[:-1] if k == NORM else v for k, v in t.items()}, r"expected \[64\]", NORM),
]


@pytest.mark.parametrize(("folder", "edit", "match", "tensor"), PART_EDITS)
def test_bad_part_tensors_are_refused_by_name(
    request: pytest.FixtureRequest, cfg: ModelConfig, folder: str, edit: Any, match: str, tensor: str | None
) -> None:
    path: Path = request.getfixturevalue(folder)
    rewrite_adapter_tensors(path, edit)
    with pytest.raises(InvalidAdapter, match=match) as info:
        index_adapter("x", path, cfg)
    if tensor is not None:
        assert info.value.tensor == tensor


def test_a_module_both_saved_and_lora_targeted_is_refused(embed_head: Path, cfg: ModelConfig) -> None:
    edit_adapter_config(embed_head, modules_to_save=["lm_head"])
    with pytest.raises(InvalidAdapter, match="lm_head is both a LoRA target and in modules_to_save"):
        index_adapter("x", embed_head, cfg)


def test_saved_modules_are_bounded_counted_and_loaded(saved: Path, cfg: ModelConfig) -> None:
    """Over ``max_saved_bytes`` (serving dtype) registration is RESOURCE_EXHAUSTED naming the modules; under it
    the saved weights load beside the deltas, counted in the device bytes, and replace nothing else."""
    tensors = load_file(saved / "adapter_model.safetensors")
    saved_bytes = sum(t.numel() * 4 for k, t in tensors.items() if "lora_" not in k)
    tight = _store(cfg, max_saved_bytes=saved_bytes - 1)
    try:
        with pytest.raises(ResourceExhausted, match=r"saves input_layernorm, .*lm_head: \d+ bytes .*max-saved-module"):
            tight.register("mts", saved)
        assert tight.list() == []
    finally:
        tight.close()
    store = _store(cfg, max_saved_bytes=saved_bytes)
    try:
        info = store.register("mts", saved)
        assert info.saved_modules == ("input_layernorm", "post_attention_layernorm", "norm", "lm_head")
        store.ensure("mts", timeout=30)
        info = store.get("mts")
        assert info.device_bytes >= saved_bytes and info.host_bytes >= saved_bytes
        store.pin("mts")
        top = store.layer("mts", cfg.num_layers)
        assert top is not None and set(top.saved) == {"norm", "lm_head"} and not top.modules
        head = "base_model.model.lm_head.weight"
        torch.testing.assert_close(top.saved["lm_head"], tensors[head], rtol=0, atol=0)
        layer1 = store.layer("mts", 1)
        assert layer1 is not None and set(layer1.saved) == {"input_layernorm", "post_attention_layernorm"}
        assert set(layer1.modules) == {"q_proj", "v_proj"}
        store.unpin("mts")
    finally:
        store.close()


def test_a_non_finite_saved_weight_fails_its_load_naming_it(saved: Path, cfg: ModelConfig) -> None:
    rewrite_adapter_tensors(
        saved, lambda t: {k: v.clone().fill_(float("nan")) if k == NORM else v for k, v in t.items()}
    )
    store = _store(cfg)
    try:
        store.register("mts", saved)
        with pytest.raises(NonFiniteTensor) as info:
            store.ensure("mts", timeout=30)
        assert info.value.tensor == NORM
    finally:
        store.close()


def test_saved_modules_have_no_weighted_sum_but_keep_under_a_scale() -> None:
    """One adapter at a weight keeps its saved weights (peft's scale leaves them as trained); a sum of two refuses."""
    norm = torch.ones(4)
    layer = LoraLayer(modules={}, nbytes=16, saved={"norm": norm})
    assert compose_layer([(layer, 0.5)]).saved["norm"] is norm
    with pytest.raises(InvalidRequest, match="modules_to_save"):
        compose_layer([(layer, 0.5), (LoraLayer(modules={}, nbytes=0), 0.5)])
