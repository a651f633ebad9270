"""PEFT LoRA format: which modules an adapter_config.json targets, with which rank and scaling, checked against
peft itself; the index built from the safetensors header points at exactly the bytes peft loads; every bad
adapter is refused by name (file and tensor) before a tensor byte is read."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.adapter_files import edit_adapter_config, load_peft_model, rewrite_adapter_tensors, write_peft_adapter

from service.adapters.common.ids import check_adapter_id
from service.adapters.lora.peft import module_key, parse_lora_key, read_lora_config, resolve_targets
from service.adapters.lora.registry import index_adapter
from service.adapters.lora.store import AdapterStore
from service.errors import HeaderError, InvalidAdapter, InvalidRequest, NotFound, PermissionDenied
from service.model.config import ModelConfig

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def base4(tiny_llama_factory: Callable[..., Path]) -> Path:
    """A tiny Llama with 4 layers, so layer selection has something to select."""
    return tiny_llama_factory(num_hidden_layers=4, seed=3)


@pytest.fixture(scope="module")
def cfg4(base4: Path) -> ModelConfig:
    return ModelConfig.from_hf(base4)


@pytest.fixture(scope="module")
def base_model(base4: Path) -> Any:
    """One loaded transformers model reused by every write_peft_adapter call of this module."""
    from support.tiny_models import load_hf_llama

    return load_hf_llama(base4)


def _peft_targets(model: Any) -> dict[tuple[int, str], tuple[int, float]]:
    """What peft built: (layer, module) -> (r, scaling) of every LoRA layer of adapter 'default'."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "r", {}):
            key = name.split("base_model.model.", 1)[-1]
            parts = key.split(".")
            out[(int(parts[2]), parts[4])] = (module.r["default"], module.scaling["default"])
    return out


CONFIGS: dict[str, dict[str, Any]] = {
    "list": {"target_modules": ["q_proj", "v_proj"]},
    "all-linear": {"target_modules": "all-linear"},
    "regex": {"target_modules": r"model\.layers\.[13]\.(self_attn\.(k|o)_proj|mlp\.up_proj)"},
    "layers": {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [0, 2]},
    "layers-pattern": {"target_modules": ["gate_proj"], "layers_to_transform": 3, "layers_pattern": "layers"},
    "patterns": {
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
        "rank_pattern": {r"layers\.1\.self_attn\.q_proj": 2, "down_proj": 6, "o_proj": 3},
        "alpha_pattern": {r"model\.layers\.[02]\.self_attn\.v_proj": 5, "k_proj": 32},
    },
    "rslora": {"target_modules": ["q_proj", "up_proj"], "use_rslora": True, "lora_alpha": 12},
    "exclude": {"target_modules": ["q_proj", "v_proj"], "exclude_modules": r"model\.layers\.2\..*"},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_targets_ranks_and_scaling_match_peft(name: str, base_model: Any, cfg4: ModelConfig, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    kwargs = {"r": 4, "lora_alpha": 8, **CONFIGS[name]}
    peft_model = get_peft_model(base_model, LoraConfig(**kwargs))
    try:
        expected = _peft_targets(peft_model)
        peft_model.peft_config["default"].save_pretrained(tmp_path)
    finally:
        peft_model.unload()
    assert expected, "the case must target something"
    config = read_lora_config(tmp_path / "adapter_config.json")
    got = resolve_targets(config, cfg4, file=tmp_path)
    assert set(got) == set(expected)
    from service.adapters.lora.peft import lora_scaling

    for key, (rank, alpha) in got.items():
        assert rank == expected[key][0], key
        assert lora_scaling(rank, alpha, config.use_rslora) == pytest.approx(expected[key][1], rel=1e-12), key


@pytest.mark.parametrize("infix", [None, "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_points_at_the_bytes_peft_loads(
    infix: str | None, dtype: torch.dtype, base_model: Any, base4: Path, cfg4: ModelConfig, tmp_path: Path
) -> None:
    folder = write_peft_adapter(
        tmp_path / "a",
        base_model,
        r=4,
        target_modules=("q_proj", "k_proj", "down_proj"),
        rank_pattern={"down_proj": 2},
        layers_to_transform=[1, 3],
        dtype=dtype,
        infix=infix,
    )
    spec = index_adapter("a", folder, cfg4)
    assert spec.layers == (1, 3)
    assert spec.modules == ("q_proj", "k_proj", "down_proj")
    assert spec.module_ranks() == {"q_proj": 4, "k_proj": 4, "down_proj": 2}
    if infix:
        assert all(".default.weight" in k for k in load_file(folder / "adapter_model.safetensors"))
        folder_plain = tmp_path / "plain"
        shutil.copytree(folder, folder_plain)
        rewrite_adapter_tensors(folder_plain, lambda t: {k.replace(".default", ""): v for k, v in t.items()})
        reference_dir = folder_plain  # current peft cannot load the old infix spelling itself
    else:
        reference_dir = folder
    peft_model = load_peft_model(base4, {"x": reference_dir})
    modules = dict(peft_model.named_modules())
    raw = (folder / "adapter_model.safetensors").read_bytes()
    total = 0
    for layer in range(cfg4.num_layers):
        for s in spec.layer_records(layer):
            lora = modules[f"base_model.model.{module_key(layer, s.module)}"]
            for rec, ref in ((s.a, lora.lora_A["x"].weight), (s.b, lora.lora_B["x"].weight)):
                got = torch.frombuffer(bytearray(raw[rec.start : rec.start + rec.nbytes]), dtype=rec.torch_dtype)
                assert torch.equal(got.view(rec.shape), ref.detach().to(rec.torch_dtype)), rec.name
                total += rec.nbytes
            assert s.scaling == lora.scaling["x"]
    assert total == spec.raw_nbytes()


def test_key_names() -> None:
    key = parse_lora_key("base_model.model.model.layers.12.mlp.down_proj.lora_B.weight")
    assert key is not None and (key.layer, key.module, key.matrix, key.infix) == (12, "down_proj", "B", "")
    key = parse_lora_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    assert key is not None and key.infix == ".default"
    for bad in (
        "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",  # q_proj is not under mlp
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.model.embed_tokens.lora_embedding_A",
    ):
        assert parse_lora_key(bad) is None, bad


# --- refusals ---------------------------------------------------------------------------------------------


@pytest.fixture()
def good(base_model: Any, tmp_path: Path) -> Path:
    return write_peft_adapter(tmp_path / "good", base_model, r=4, target_modules=("q_proj", "v_proj"))


def _refused(folder: Path, cfg: ModelConfig, *, match: str, error: type[Exception] = InvalidAdapter) -> Exception:
    with pytest.raises(error, match=match) as info:
        index_adapter("x", folder, cfg)
    return info.value


def test_missing_config(good: Path, cfg4: ModelConfig) -> None:
    (good / "adapter_config.json").unlink()
    e = _refused(good, cfg4, match="needs adapter_config.json")
    assert isinstance(e, InvalidAdapter) and e.file == str(good / "adapter_config.json")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_corrupt_config(good: Path, cfg4: ModelConfig, text: str) -> None:
    (good / "adapter_config.json").write_text(text)
    e = _refused(good, cfg4, match="adapter_config.json")
    assert isinstance(e, InvalidAdapter) and e.file == str(good / "adapter_config.json")


def test_pickled_weights_refused_with_conversion_hint(good: Path, cfg4: ModelConfig) -> None:
    tensors = load_file(good / "adapter_model.safetensors")
    (good / "adapter_model.safetensors").unlink()
    torch.save(tensors, good / "adapter_model.bin")
    e = _refused(good, cfg4, match=r"save_pretrained\(OUT_DIR, safe_serialization=True\)")
    assert isinstance(e, InvalidAdapter) and e.file == str(good / "adapter_model.bin")


def test_missing_weights(good: Path, cfg4: ModelConfig) -> None:
    (good / "adapter_model.safetensors").unlink()
    _refused(good, cfg4, match="no adapter_model.safetensors")


def test_truncated_and_corrupt_safetensors(good: Path, cfg4: ModelConfig) -> None:
    file = good / "adapter_model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    e = _refused(good, cfg4, match="data section|out of range|cover", error=HeaderError)
    assert isinstance(e, HeaderError) and e.file == str(file.resolve())
    file.write_bytes(b"\xff" * 8 + data[8:])
    _refused(good, cfg4, match="header length", error=HeaderError)
    file.write_bytes(data[:5])
    _refused(good, cfg4, match="truncated", error=HeaderError)


def test_shape_mismatch_with_the_base(
    tiny_llama_factory: Callable[..., Path], cfg4: ModelConfig, tmp_path: Path
) -> None:
    other = tiny_llama_factory(num_hidden_layers=4, intermediate_size=128, seed=3)
    folder = write_peft_adapter(tmp_path / "a", other, r=4, target_modules=("q_proj", "down_proj"))
    e = _refused(folder, cfg4, match=r"in_features=96")
    assert isinstance(e, InvalidAdapter) and e.tensor is not None and "down_proj.lora_A" in e.tensor


def test_layers_outside_the_model(base_model: Any, tmp_path: Path, tiny_llama_factory: Callable[..., Path]) -> None:
    folder = write_peft_adapter(tmp_path / "a", base_model, r=4, target_modules=("q_proj",))
    two_layers = ModelConfig.from_hf(tiny_llama_factory(num_hidden_layers=2, seed=3))
    e = _refused(folder, two_layers, match="layer 2 is outside the base model's 2 layers|4 problems")
    assert isinstance(e, InvalidAdapter) and e.tensor is not None and "layers.2." in e.tensor


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"target_modules": ["q_proj", "v_proj", "c_attn"]}, "target module 'c_attn' not found in the base model"),
        ({"target_modules": r"transformer\.h\.\d+\.attn"}, "matches no module of the base model"),
        ({"target_modules": ["q_proj", "v_proj", "lm_head"]}, "targets lm_head, but the file has no lora_A"),
        ({"target_modules": ["q_proj", "v_proj", "input_layernorm"]}, "cannot adapt: 'model.layers.0.input_layernorm'"),
        ({"target_modules": ["q_proj", "v_proj", "mlp"]}, "cannot adapt: 'model.layers.0.mlp'"),
        ({"use_dora": True}, "use_dora is set, but the module has no lora_magnitude_vector"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save lists lm_head, but the file has no tensor"),
        ({"modules_to_save": ["norm"]}, "modules_to_save lists model.layers.0.input_layernorm, but the file has no"),
        ({"modules_to_save": ["q_proj"]}, "selects 'model.layers.0.self_attn.q_proj', which loraplex cannot replace"),
        ({"modules_to_save": ["layers.1"]}, "selects 'model.layers.1', which loraplex cannot replace"),
        ({"modules_to_save": ["classifier"]}, "modules_to_save entry 'classifier' matches no module"),
        ({"modules_to_save": "lm_head"}, "modules_to_save must be a list of module names"),
        ({"ensure_weight_tying": True}, "ensure_weight_tying"),
        ({"bias": "some"}, "bias must be 'none', 'lora_only' or 'all'"),
        ({"lora_bias": True}, "lora_bias is set, but the module has no lora_B bias"),
        ({"lora_bias": True, "use_dora": True}, r"use_dora and lora_bias"),
        ({"r": 0}, "r must be a positive integer"),
        ({"r": -2}, "r must be a positive integer"),
        ({"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\] must be a positive integer"),
        ({"lora_alpha": "big"}, "lora_alpha must be a finite number"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
        ({"target_modules": "(unclosed"}, "not a valid regular expression"),
        ({"r": 8}, "rank 4 in the file, but adapter_config.json gives this module r=8"),
        ({"target_modules": ["q_proj", "v_proj", "k_proj"]}, "targets 4 module"),
        ({"target_modules": ["q_proj"]}, "does not target model.layers.0.self_attn.v_proj"),
    ],
)
def test_config_refusals(good: Path, cfg4: ModelConfig, changes: dict[str, Any], match: str) -> None:
    edit_adapter_config(good, **changes)
    e = _refused(good, cfg4, match=match)
    assert (
        isinstance(e, InvalidAdapter)
        and e.file is not None
        and Path(e.file).name
        in (
            "adapter_config.json",
            "adapter_model.safetensors",
        )
    )


def test_dora_file_written_by_peft_is_indexed_with_its_magnitudes(
    base_model: Any, cfg4: ModelConfig, tmp_path: Path
) -> None:
    """Registration indexes each module's lora_magnitude_vector at the bytes peft wrote (header only)."""
    folder = write_peft_adapter(tmp_path / "d", base_model, r=4, use_dora=True)
    spec = index_adapter("d", folder, cfg4)
    tensors = load_file(folder / "adapter_model.safetensors")
    assert spec.config.use_dora and spec.layers
    for layer in spec.layers:
        for s in spec.layer_records(layer):
            assert s.m is not None and s.m.name in tensors and s.m.shape == tuple(tensors[s.m.name].shape)
    assert spec.extras_nbytes(torch.float32) > 0


def test_dora_magnitudes_are_checked_before_any_load(base_model: Any, cfg4: ModelConfig, tmp_path: Path) -> None:
    folder = write_peft_adapter(tmp_path / "d", base_model, r=4, use_dora=True)
    q_m = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    rewrite_adapter_tensors(folder, lambda t: {k: v[:-1] if k == q_m else v for k, v in t.items()})
    e = _refused(folder, cfg4, match="DoRA's magnitude must be")
    assert isinstance(e, InvalidAdapter) and e.tensor == q_m
    edit_adapter_config(folder, use_dora=False)  # a lying config: the magnitude vectors still give it away
    e = _refused(folder, cfg4, match="does not set use_dora")
    assert isinstance(e, InvalidAdapter) and "lora_magnitude_vector" in (e.tensor or str(e))


def test_dora_needs_the_base_weights(base_model: Any, cfg4: ModelConfig, tmp_path: Path) -> None:
    """A store built without the base model's weights (``KindContext.base`` None) refuses DoRA by name."""
    folder = write_peft_adapter(tmp_path / "d", base_model, r=4, use_dora=True)
    store = AdapterStore(
        cfg4, device=torch.device("cpu"), dtype=torch.float32, device_budget_bytes=1 << 24, host_budget_bytes=1 << 24
    )
    try:
        with pytest.raises(InvalidAdapter, match="needs the base model's weights"):
            store.register("d", folder)
    finally:
        store.close()


Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
TENSOR_EDITS: list[tuple[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], str, str | None]] = [
    (lambda t: {k: v for k, v in t.items() if k != Q_B}, "no matching lora_B", "q_proj.lora_A"),
    (lambda t: {**t, Q_B.replace("lora_B.weight", "bias"): torch.zeros(64)}, "a base-layer bias", ".bias"),
    (lambda t: {**t, Q_B.replace("weight", "bias"): torch.zeros(64)}, "does not set lora_bias", "lora_B.bias"),
    (lambda t: {**t, "something.else": torch.zeros(3)}, "unexpected tensor", "something.else"),
    (
        lambda t: {k: v[:, :3] if k == Q_B else v for k, v in t.items()},
        "rank 3 differs from the rank 4",
        "q_proj.lora_B",
    ),
    (lambda t: {k: v.int() if "v_proj.lora_A" in k else v for k, v in t.items()}, "not a float type", "v_proj.lora_A"),
    (lambda t: {}, "holds no LoRA tensors|targets", None),
]


@pytest.mark.parametrize(("edit", "match", "tensor"), TENSOR_EDITS)
def test_tensor_refusals(
    good: Path,
    cfg4: ModelConfig,
    edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    match: str,
    tensor: str | None,
) -> None:
    rewrite_adapter_tensors(good, edit)
    e = _refused(good, cfg4, match=match)
    assert isinstance(e, InvalidAdapter) and e.file == str((good / "adapter_model.safetensors").resolve())
    if tensor is not None:
        assert e.tensor is not None and tensor in e.tensor


# --- ids and paths ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", ".hidden", "a/b", "a b", "x" * 129, "..", "é"])
def test_bad_ids(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        check_adapter_id(bad)


@pytest.mark.parametrize("ok", ["a", "caps", "My_Adapter-v1.2", "x" * 128, "0"])
def test_good_ids(ok: str) -> None:
    check_adapter_id(ok)


def test_paths_must_stay_inside_the_roots(good: Path, cfg4: ModelConfig, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    inside = root / "a"
    shutil.copytree(good, inside)
    assert index_adapter("a", inside, cfg4, roots=[root]).file == (inside / "adapter_model.safetensors").resolve()
    for path in (good, root / ".." / "good"):
        with pytest.raises(PermissionDenied):
            index_adapter("a", path, cfg4, roots=[root])
    (root / "link").symlink_to(good, target_is_directory=True)  # a symlinked folder pointing out
    with pytest.raises(PermissionDenied):
        index_adapter("a", root / "link", cfg4, roots=[root])
    sneaky = root / "sneaky"  # a folder inside whose weights file is a symlink to a file outside
    sneaky.mkdir()
    shutil.copy(good / "adapter_config.json", sneaky)
    os.symlink(good / "adapter_model.safetensors", sneaky / "adapter_model.safetensors")
    with pytest.raises(PermissionDenied):
        index_adapter("a", sneaky, cfg4, roots=[root])
    with pytest.raises(NotFound, match="does not exist"):  # the proto promises NOT_FOUND for a missing path
        index_adapter("a", root / "missing", cfg4, roots=[root])
    (root / "plain-file").write_text("x")
    with pytest.raises(InvalidAdapter, match="not a folder"):
        index_adapter("a", root / "plain-file", cfg4, roots=[root])
