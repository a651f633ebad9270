"""service.model.load_folder: the HF-name -> fused-slice plan and load_model, against the files transformers wrote."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.tiny_models import load_hf_llama

from service import bootstrap, metrics
from service.errors import CheckpointError, TensorMismatch
from service.model import KVCache, Llama
from service.model.load_folder import build_load_plan, load_model


def _state(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def _copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


@pytest.mark.parametrize(
    "overrides",
    [{}, {"attention_bias": True, "mlp_bias": True}, {"tie_word_embeddings": True}],
    ids=["plain", "biases", "tied"],
)
def test_every_tensor_lands_in_its_fused_slice(
    tiny_llama_factory: Callable[..., Path], overrides: dict[str, bool]
) -> None:
    folder = tiny_llama_factory(**overrides)
    model, cfg, stats = load_model(folder, dtype=torch.float32, device="cpu")
    state = _state(folder)
    plan, ignore = build_load_plan(model)
    assert set(plan) == set(state) - set(ignore)
    assert stats.tensors == len(plan)
    attn = model.blocks[1].attention
    q, k, v = (state[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(attn.wqkv, torch.cat([q, k, v]))
    gate, up = (state[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up"))
    assert torch.equal(model.blocks[1].feed_forward.w13, torch.cat([gate, up]))
    if cfg.tie_word_embeddings:
        assert model.lm_head is model.tok_embeddings
    else:
        assert torch.equal(model.lm_head, state["lm_head.weight"])
    if cfg.attention_bias:
        b = [state[f"model.layers.0.self_attn.{n}_proj.bias"] for n in "qkv"]
        assert model.blocks[0].attention.bqkv is not None
        assert torch.equal(model.blocks[0].attention.bqkv, torch.cat(b))


def test_bf16_load_converts(tiny_llama_dir: Path) -> None:
    model, _, _ = load_model(tiny_llama_dir, dtype=torch.bfloat16, device="cpu")
    state = _state(tiny_llama_dir)
    assert model.tok_embeddings.dtype == torch.bfloat16
    assert torch.equal(model.tok_embeddings, state["model.embed_tokens.weight"].to(torch.bfloat16))


def test_sharded_folder_loads_the_same_model(tiny_llama_factory: Callable[..., Path]) -> None:
    single = tiny_llama_factory(seed=7)
    sharded = tiny_llama_factory(seed=7, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, _, _ = load_model(single, dtype=torch.float32, device="cpu")
    b, _, _ = load_model(sharded, dtype=torch.float32, device="cpu")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    hf = load_hf_llama(sharded)
    ids = torch.arange(3, 20)[None, :]
    got = b.logits(b(ids, torch.arange(17)[None, :], KVCache(b.cfg, 1, 17, dtype=torch.float32, device=b.device), 0))
    with torch.no_grad():
        assert float((got - hf(ids).logits).abs().max()) < 1e-4


@pytest.mark.parametrize("mode", ["stream", "mmap", "eager"])
def test_load_records_metrics(tiny_llama_dir: Path, mode: str) -> None:
    def sample(name: str, labels: dict[str, str]) -> float:
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    count = {"stage": "total", "mode": mode}
    before_count = sample("loraplex_model_load_duration_seconds_count", count)
    before_bytes = sample("loraplex_model_load_bytes_total", {"mode": mode})
    model, _, stats = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu", mode=mode)  # type: ignore[arg-type]
    bootstrap.record_load(stats, model)  # the loader returns stats; the composition root records them
    assert sample("loraplex_model_load_duration_seconds_count", count) == before_count + 1
    assert sample("loraplex_model_load_bytes_total", {"mode": mode}) == before_bytes + stats.bytes_read
    file_bytes = sum(f.stat().st_size for f in tiny_llama_dir.glob("*.safetensors"))
    assert file_bytes - _headers(tiny_llama_dir) <= stats.bytes_read <= file_bytes  # eager also reads headers
    assert sample("loraplex_model_parameter_bytes", {}) == model.parameter_bytes
    assert sample("loraplex_model_loaded", {}) == 1
    assert stats.total_seconds >= stats.read_seconds


def _headers(folder: Path) -> int:
    total = 0
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as f:
            total += 8 + int.from_bytes(f.read(8), "little")
    return total


def test_missing_tensor_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy_folder(tiny_llama_dir, tmp_path / "m")
    state = _state(folder)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TensorMismatch, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder, dtype=torch.float32, device="cpu")


def test_misshaped_tensor_is_named_with_its_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy_folder(tiny_llama_dir, tmp_path / "m")
    state = _state(folder)
    state["model.layers.0.self_attn.k_proj.weight"] = state["model.layers.0.self_attn.k_proj.weight"][:-1].clone()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TensorMismatch) as err:
        load_model(folder, dtype=torch.float32, device="cpu")
    assert err.value.tensor == "model.layers.0.self_attn.k_proj.weight"
    assert err.value.file is not None and err.value.file.endswith("model.safetensors")


def test_unexpected_tensor_is_named_but_known_extras_are_ignored(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy_folder(tiny_llama_dir, tmp_path / "m")
    state = _state(folder)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old transformers wrote these
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    load_model(folder, dtype=torch.float32, device="cpu")
    state["model.layers.0.mlp.extra_proj.weight"] = torch.ones(2, 2)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TensorMismatch, match=r"extra_proj"):
        load_model(folder, dtype=torch.float32, device="cpu")


def test_tied_checkpoint_with_lm_head_copy_is_accepted(tiny_llama_factory: Callable[..., Path], tmp_path: Path) -> None:
    folder = _copy_folder(tiny_llama_factory(tie_word_embeddings=True), tmp_path / "m")
    state = _state(folder)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    model, _, _ = load_model(folder, dtype=torch.float32, device="cpu")
    assert model.lm_head is model.tok_embeddings


def test_unsupported_config_fails_before_reading(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy_folder(tiny_llama_dir, tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["Qwen2ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="Qwen2ForCausalLM"):
        load_model(folder, dtype=torch.float32, device="cpu")


def test_parameters_are_allocated_not_initialised() -> None:
    """The constructor must not spend time initialising: parameters come from torch.empty on the target device."""
    from service.model.config import ModelConfig

    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 24,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 64,
        }
    )
    model = Llama(cfg, dtype=torch.float32, device=torch.device("meta"))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
