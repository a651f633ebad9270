"""Medusa heads in the layouts people publish, built from real tensors the way each tool writes them.

- medusa-1 (FasterDecoding ``medusa_model.py``): ``torch.save(medusa_head.state_dict())`` to ``medusa_lm_head.pt``,
  each head ``Sequential(*[block] * n_layers, Linear(hidden, vocab))``: one block module repeated, so with two
  layers the block names share memory. Converted with ``loraplex convert medusa``.
- medusa-2 as the legacy trainer (``train_legacy.py``) writes it: heads of blocks only (the base ``lm_head``
  projects), ``safetensors.torch.save_file(state_dict)``, and a ``PretrainedConfig`` saved with ``"version": "2"``.
- LoRAX's rules (``adapters/medusa.py``): ``version`` defaults to 1 and is read with ``float()``; the layout is
  v1 when ``medusa_num_layers > 1`` or ``0.{n}.weight`` exists, else v2 (the base ``lm_head``).

Each converted or published folder is checked two ways: the served heads' logits against the structure above run
in torch (``ReferenceHeads``), and greedy output over real gRPC with speculation on against plain greedy.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex import Client, InvalidArgument
from support.servers import tiny_settings
from torch import nn

from service import metrics
from service.adapters.medusa import MedusaHeads, index_medusa, read_medusa_config
from service.adapters.medusa.convert import convert_medusa
from service.api.server import BackgroundServer
from service.cli import main
from service.errors import InvalidAdapter
from service.model.config import ModelConfig

PROMPTS = ["The quick brown fox", "Tell me about item 7", "Once upon a time"]
NEW_TOKENS = 32


class _Block(nn.Module):
    """FasterDecoding's residual block: ``x + SiLU(Linear(x))``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class ReferenceHeads(nn.Module):
    """The published module structure: per head, ONE block module repeated ``n_layers`` times (so the repeats
    share their parameters), then (medusa-1) the head's own projection; medusa-2 heads project with the base's."""

    def __init__(self, hidden: int, vocab: int, n_heads: int, n_layers: int, *, own_projection: bool, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        heads = []
        for _ in range(n_heads):
            block = _Block(hidden)
            nn.init.normal_(block.linear.weight, std=0.05)
            nn.init.normal_(block.linear.bias, std=0.05)
            parts: list[nn.Module] = [block] * n_layers
            if own_projection:
                parts.append(nn.Linear(hidden, vocab, bias=False))
            heads.append(nn.Sequential(*parts))
        self.heads = nn.ModuleList(heads)
        self.own_projection = own_projection

    @torch.no_grad()
    def logits(self, x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:  # x [B, H] -> [B, n, V]
        outs = [head(x) for head in self.heads]
        if not self.own_projection:
            outs = [y @ lm_head.T for y in outs]
        return torch.stack(outs, dim=1)


def write_medusa1_pt(folder: Path, cfg: ModelConfig, *, n_heads: int, n_layers: int, seed: int) -> ReferenceHeads:
    """A FasterDecoding medusa-1 folder: ``medusa_lm_head.pt`` (a pickled state dict) and its ``config.json``."""
    ref = ReferenceHeads(cfg.hidden_size, cfg.vocab_size, n_heads, n_layers, own_projection=True, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(ref.heads.state_dict(), folder / "medusa_lm_head.pt")
    config = {"medusa_num_heads": n_heads, "medusa_num_layers": n_layers, "base_model_name_or_path": "tiny"}
    (folder / "config.json").write_text(json.dumps(config))
    return ref


def write_legacy_medusa2(folder: Path, cfg: ModelConfig, *, n_heads: int, seed: int) -> ReferenceHeads:
    """What ``train_legacy.py`` leaves: ``MedusaConfig(..., version="2").save_pretrained`` + ``save_file``."""
    from safetensors.torch import save_file
    from transformers import PretrainedConfig

    class MedusaConfig(PretrainedConfig):  # the trainer's config class: four attributes on a PretrainedConfig
        def __init__(self, medusa_num_heads: int = 4, medusa_num_layers: int = 1, version: str = "2",
                     base_model_name_or_path: str = "", **kwargs: Any) -> None:  # fmt: skip
            super().__init__(**kwargs)
            self.medusa_num_heads = medusa_num_heads
            self.medusa_num_layers = medusa_num_layers
            self.version = version
            self.base_model_name_or_path = base_model_name_or_path

    ref = ReferenceHeads(cfg.hidden_size, cfg.vocab_size, n_heads, 1, own_projection=False, seed=seed)
    MedusaConfig(n_heads, 1, "2", "tiny").save_pretrained(folder)
    save_file(ref.heads.state_dict(), str(folder / "medusa_lm_head.safetensors"))
    return ref


def check_against_reference(folder: Path, cfg: ModelConfig, ref: ReferenceHeads, version: int) -> None:
    spec = index_medusa(folder, cfg)
    assert spec.version == version
    heads = MedusaHeads.load(spec, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, cfg.hidden_size, generator=g)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    torch.testing.assert_close(heads.logits(x, lm_head), ref.logits(x, lm_head), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def cfg(served_tiny_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(served_tiny_dir)


# --- config.json as published --------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "want"), [(1, 1), (2, 2), ("1", 1), ("2", 2), (2.0, 2), (None, None)])
def test_version_as_published(tmp_path: Path, value: object, want: int | None) -> None:
    raw: dict[str, object] = {"medusa_num_heads": "3", "medusa_num_layers": 1}
    if value is not None:
        raw["version"] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = read_medusa_config(tmp_path / "config.json")
    assert (config.num_heads, config.num_layers, config.version) == (3, 1, want)


@pytest.mark.parametrize("value", [3, "3", "two", "", " 2", "2.0", True, 2.5, "1" * 40])
def test_other_versions_are_refused_by_value(tmp_path: Path, value: object) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1, "version": value}))
    with pytest.raises(InvalidAdapter, match="version must be 1 or 2") as info:
        read_medusa_config(tmp_path / "config.json")
    assert Path(str(info.value.file)).name == "config.json"


# --- medusa-1 .pt -> loraplex convert medusa ------------------------------------------------------------


@pytest.mark.parametrize("n_layers", [1, 2])
def test_medusa1_pt_converts_to_the_same_heads(
    tmp_path: Path, cfg: ModelConfig, served_tiny_dir: Path, n_layers: int
) -> None:
    src = tmp_path / "medusa-vicuna"
    ref = write_medusa1_pt(src, cfg, n_heads=3, n_layers=n_layers, seed=n_layers)
    state = torch.load(src / "medusa_lm_head.pt", weights_only=True)
    if n_layers == 2:  # the published one-liner fails on exactly this file
        from safetensors.torch import save_file

        with pytest.raises(RuntimeError, match="share memory"):
            save_file(state, str(tmp_path / "naive.safetensors"))
    with pytest.raises(InvalidAdapter, match="loraplex convert medusa"):
        index_medusa(src, cfg)  # the refusal names the command

    assert main(["convert", "medusa", str(src), str(tmp_path / "out"), "--model", str(served_tiny_dir)]) == 0
    converted = json.loads((tmp_path / "out" / "config.json").read_text())
    assert converted == {
        "medusa_num_heads": 3, "medusa_num_layers": n_layers, "version": 1, "base_model_name_or_path": "tiny",
    }  # fmt: skip
    check_against_reference(tmp_path / "out", cfg, ref, version=1)
    assert not (tmp_path / ".out.converting").exists()


def test_convert_counts_shared_tensors_and_keeps_dtype(tmp_path: Path, cfg: ModelConfig) -> None:
    ref = ReferenceHeads(cfg.hidden_size, cfg.vocab_size, 2, 3, own_projection=True, seed=4).to(torch.bfloat16)
    (tmp_path / "src").mkdir()
    state = {f"medusa_head.{k}": v for k, v in ref.heads.state_dict().items()}  # a whole-model state dict's names
    torch.save(state, tmp_path / "src" / "medusa_lm_head.pt", _use_new_zipfile_serialization=False)  # pre-1.6
    done = convert_medusa(tmp_path / "src" / "medusa_lm_head.pt", tmp_path / "out")
    assert (done.num_heads, done.num_layers, done.version, done.dtype) == (2, 3, 1, torch.bfloat16)
    assert done.shared_tensors == 2 * 2 * 2  # per head, blocks 1 and 2 repeat block 0 (weight and bias)
    assert done.notes == ()  # no config.json beside the pickle: nothing to disagree with
    check_against_reference(tmp_path / "out", cfg, ref.float(), version=1)


def test_config_that_disagrees_with_the_tensors_is_reported(tmp_path: Path, cfg: ModelConfig) -> None:
    src = tmp_path / "src"
    write_medusa1_pt(src, cfg, n_heads=5, n_layers=1, seed=0)
    (src / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    done = convert_medusa(src, tmp_path / "out")
    assert done.num_heads == 5 and len(done.notes) == 1 and "medusa_num_heads=2" in done.notes[0]
    assert read_medusa_config(tmp_path / "out" / "config.json").num_heads == 5


class _RunsCode:
    """A pickle payload that would create ``path`` when unpickled by a full (unsafe) ``torch.load``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def test_convert_refuses_what_is_not_plain_heads(tmp_path: Path, cfg: ModelConfig) -> None:
    def refused(state: object, *words: str, raw: bytes | None = None) -> InvalidAdapter:
        folder = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        pt = folder / "medusa_lm_head.pt"
        if raw is not None:
            pt.write_bytes(raw)
        else:
            torch.save(state, pt)
        with pytest.raises(InvalidAdapter) as info:
            convert_medusa(folder, folder / "out")
        for word in words:
            assert word in str(info.value), str(info.value)
        assert not (folder / "out").exists()
        return info.value

    h, v = cfg.hidden_size, cfg.vocab_size
    good = ReferenceHeads(h, v, 2, 1, own_projection=True, seed=0).heads.state_dict()
    marker = tmp_path / "code-ran"
    refused({"0.0.linear.weight": _RunsCode(marker)}, "weights-only")
    assert not marker.exists()  # the payload never ran
    refused(None, "weights-only", raw=b"not a pickle at all")
    refused([1, 2], "expected a state dict")
    refused({**good, "lm_head.weight": torch.zeros(v, h)}, "not a Medusa head tensor", "lm_head.weight")
    refused({k: val for k, val in good.items() if k != "1.0.linear.bias"}, "head 1", "1.0.linear.bias")
    refused({**good, "1.1.weight": torch.zeros(7, h)}, "shape (7, ", "1.1.weight")
    refused({**good, "0.0.linear.bias": torch.full((h,), float("nan"))}, "non-finite", "0.0.linear.bias")
    refused({**good, "0.0.linear.bias": torch.zeros(h, dtype=torch.int64)}, "one float dtype")
    refused({k.replace("1.", "2.", 1): val for k, val in good.items()}, "head(s) [1] missing")
    no_out = {k: val for k, val in good.items() if not k.endswith(".1.weight") or k.startswith("0.")}
    refused(no_out, "the heads differ in structure")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(InvalidAdapter, match="not an empty folder"):
        convert_medusa(tmp_path / "case1", tmp_path / "full")


def test_cli_reports_a_bad_source_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "medusa", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex convert: ") and "no such file or folder" in err


def test_cli_model_check_removes_heads_that_do_not_fit(
    tmp_path: Path, cfg: ModelConfig, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = ModelConfig.from_hf(tiny_llama_dir)
    assert other.vocab_size != cfg.vocab_size
    write_medusa1_pt(tmp_path / "src", cfg, n_heads=2, n_layers=1, seed=0)
    argv = ["convert", "medusa", str(tmp_path / "src"), str(tmp_path / "out"), "--model", str(tiny_llama_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"vocab_size={other.vocab_size}" in err and "removed" in err
    assert not (tmp_path / "out").exists()


# --- LoRAX's detection rules ----------------------------------------------------------------------------

# (name, heads written with own projections?, blocks, version in config.json (absent: LoRAX assumes 1))
LORAX_CASES = [
    ("lorax-v1-no-version", True, 1, None),  # 0.1.weight present -> MedusaV1
    ("lorax-v2-no-version", False, 1, None),  # one block, no 0.1.weight -> MedusaV2 (base lm_head)
    ("lorax-v1-two-blocks", True, 2, None),  # medusa_num_layers > 1 -> MedusaV1
    ("lorax-v2-int", False, 1, 2),
    ("lorax-v2-float", False, 1, 2.0),  # LoRAX reads float(version)
    ("lorax-v2-string", False, 1, "2"),
    ("lorax-v1-string", True, 1, "1"),
]


def write_lorax_case(folder: Path, cfg: ModelConfig, own: bool, n_layers: int, version: object) -> ReferenceHeads:
    from safetensors.torch import save_file

    ref = ReferenceHeads(cfg.hidden_size, cfg.vocab_size, 3, n_layers, own_projection=own, seed=n_layers + own)
    folder.mkdir(parents=True)
    tensors = {k: v.clone() for k, v in ref.heads.state_dict().items()}  # LoRAX reads files without shared names
    save_file(tensors, str(folder / "medusa_lm_head.safetensors"))
    config: dict[str, object] = {"medusa_num_heads": 3, "medusa_num_layers": n_layers, "base_model_name_or_path": "t"}
    if version is not None:
        config["version"] = version
    (folder / "config.json").write_text(json.dumps(config))
    return ref


@pytest.mark.parametrize(("name", "own", "n_layers", "version"), LORAX_CASES, ids=[c[0] for c in LORAX_CASES])
def test_lorax_detection_cases(
    tmp_path: Path, cfg: ModelConfig, name: str, own: bool, n_layers: int, version: object
) -> None:
    ref = write_lorax_case(tmp_path / name, cfg, own, n_layers, version)
    check_against_reference(tmp_path / name, cfg, ref, version=1 if own else 2)


def test_legacy_medusa2_folder_matches_reference(tmp_path: Path, cfg: ModelConfig) -> None:
    ref = write_legacy_medusa2(tmp_path / "legacy", cfg, n_heads=3, seed=9)
    assert json.loads((tmp_path / "legacy" / "config.json").read_text())["version"] == "2"
    check_against_reference(tmp_path / "legacy", cfg, ref, version=2)


# --- served over gRPC: greedy output equals plain greedy ------------------------------------------------


@pytest.fixture(scope="module")
def published(served_tiny_dir: Path, cfg: ModelConfig, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layout above in one adapter folder (the medusa-1 pickles converted with the CLI)."""
    root = tmp_path_factory.mktemp("published")
    raw = tmp_path_factory.mktemp("published_raw")
    for n_layers in (1, 2):
        write_medusa1_pt(raw / f"m1-{n_layers}", cfg, n_heads=3, n_layers=n_layers, seed=10 + n_layers)
        assert main(["convert", "medusa", str(raw / f"m1-{n_layers}"), str(root / f"medusa1-{n_layers}layer")]) == 0
    write_legacy_medusa2(root / "medusa2-legacy", cfg, n_heads=3, seed=3)
    for name, own, n_layers, version in LORAX_CASES:
        write_lorax_case(root / name, cfg, own, n_layers, version)
    return root


@pytest.fixture(scope="module")
def server_settings(published: Path) -> dict[str, object]:
    return {"adapter_dirs": (published,), "max_batch_size": 8, "speculate_max_batch": 8, "speculate_adaptive": False}


def greedy(client: Client, prompt: str, adapter: str | None) -> list[int]:
    g = client.generate(
        prompt,
        adapter=adapter,
        speculate=True if adapter else None,
        max_new_tokens=NEW_TOKENS,
        ignore_eos=True,
        return_token_ids=True,
    )
    return list(g.token_ids)


def test_every_published_layout_serves_plain_greedy(server: BackgroundServer, published: Path) -> None:
    names = sorted(p.name for p in published.iterdir())
    with Client(server.target, timeout=120) as client:
        listed = {a.id: (a.kind.value, a.medusa_heads) for a in client.list_adapters()}
        assert listed == {name: ("medusa", 3) for name in names}
        plain = [greedy(client, p, None) for p in PROMPTS]
        for name in names:
            drafted = metrics.SPECULATIVE_DRAFTED._value.get()
            for prompt, want in zip(PROMPTS, plain, strict=True):
                assert greedy(client, prompt, name) == want, f"{name}: {prompt!r}"
            assert metrics.SPECULATIVE_DRAFTED._value.get() > drafted, f"{name}: the heads drafted nothing"


def test_an_unconverted_pickle_is_refused_naming_the_command(
    server: BackgroundServer, published: Path, cfg: ModelConfig
) -> None:
    folder = published / "raw-pickle"
    write_medusa1_pt(folder, cfg, n_heads=2, n_layers=1, seed=0)
    with Client(server.target, timeout=60) as client, pytest.raises(InvalidArgument, match="loraplex convert medusa"):
        client.load_adapter("raw-pickle", folder)


def test_pickle_helper_is_a_real_payload(tmp_path: Path) -> None:
    """The refusal test above is only meaningful if an unsafe load of the payload really runs it."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_RunsCode(marker)))
    assert marker.is_dir()


@pytest.mark.slow
def test_published_layouts_on_smollm2(smollm2_dir: Path, tmp_path: Path) -> None:
    """The real model: a converted medusa-1 pickle (bf16, one head of two shared blocks) and a legacy medusa-2
    folder, each speculating over real gRPC, with greedy output equal to plain greedy."""
    cfg = ModelConfig.from_hf(smollm2_dir)
    root = tmp_path / "adapters"
    ref = ReferenceHeads(cfg.hidden_size, cfg.vocab_size, 1, 2, own_projection=True, seed=1).to(torch.bfloat16)
    (tmp_path / "m1").mkdir()
    torch.save(ref.heads.state_dict(), tmp_path / "m1" / "medusa_lm_head.pt")
    assert main(["convert", "medusa", str(tmp_path / "m1"), str(root / "m1"), "--model", str(smollm2_dir)]) == 0
    write_legacy_medusa2(root / "m2", cfg, n_heads=3, seed=2)
    settings = tiny_settings(
        smollm2_dir, adapter_dirs=(root,), speculate_max_batch=8, speculate_adaptive=False, max_total_tokens=512
    )
    with BackgroundServer(settings) as srv, Client(srv.target, timeout=300) as client:
        for prompt in PROMPTS[:2]:
            want = greedy(client, prompt, None)
            for name in ("m1", "m2"):
                drafted = metrics.SPECULATIVE_DRAFTED._value.get()
                assert greedy(client, prompt, name) == want, f"{name}: {prompt!r}"
                assert metrics.SPECULATIVE_DRAFTED._value.get() > drafted
