"""Medusa heads on the tiny random Llama: format validation, the heads' math, verification and the speculative loop.

References: the heads' math against a per-head reimplementation of the reference ``ResBlock`` + projection built
from ``safetensors.torch.load_file``; the loop's plain path against ``tiny_models.greedy_generate``; the speculative
loop against the plain loop, token for token (on a dense, an int4 and a GGUF base, the last with and without dense
copies); the KV cache after speculation against a fresh prefill of the same
tokens; LoRA rows through the batched LoRA math (``AdapterBatch``) with peft-written adapters; rejection sampling
against the exact target distribution.

To make drafts right often enough that partial acceptance is exercised, the "predictable" tiny model scales the
attention and MLP outputs down (the residual stream then mostly carries the current token, so the greedy text is
learnable) and its heads are trained by ``tools.medusa.train`` on the model's own greedy text.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.tiny_models import greedy_generate, load_ours

from service.adapters.medusa import MedusaHeads, index_medusa, is_medusa_folder, read_medusa_config
from service.adapters.medusa.format import weight_files, write_medusa
from service.errors import InvalidAdapter
from service.model import KVCache, ModelConfig
from tools.medusa import PAD, generate, verify_greedy, verify_sampling
from tools.medusa.train import head_accuracy, head_dataset, teacher_hidden, train_v2_heads

EOS = 2


def random_heads(
    cfg: ModelConfig, *, n_heads: int, n_layers: int, version: int, seed: int, vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random stacked head weights (block [L, n, H, H], bias [L, n, H], v1 out [n, V, H])."""
    g = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    weight = torch.randn(n_layers, n_heads, h, h, generator=g) / h**0.5
    bias = 0.1 * torch.randn(n_layers, n_heads, h, generator=g)
    out = torch.randn(n_heads, vocab or cfg.vocab_size, h, generator=g) if version == 1 else None
    return weight, bias, out


def write_random_heads(
    folder: Path,
    cfg: ModelConfig,
    *,
    version: int,
    n_heads: int = 3,
    n_layers: int = 1,
    seed: int = 0,
    explicit_version: bool = True,
) -> Path:
    w, b, out = random_heads(cfg, n_heads=n_heads, n_layers=n_layers, version=version, seed=seed)
    return write_medusa(folder, w, b, out, version=version if explicit_version else None)


def prompts_for(cfg: ModelConfig, count: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (count,), generator=g).tolist()
    return [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> dict[str, Any]:
    model = load_ours(tiny_llama_dir)
    return {"dir": tiny_llama_dir, "model": model, "cfg": model.cfg}


@pytest.fixture(scope="module")
def tiny_int4(tiny_llama_dir: Path) -> dict[str, Any]:
    """The tiny model on an int4-quantized base: speculation must stay token-identical to its own plain decoding
    (verification runs k + 1 rows per step, so it takes the other ``weights.linear`` path than a plain step)."""
    model = load_ours(tiny_llama_dir, quantize="int4")
    return {"dir": tiny_llama_dir, "model": model, "cfg": model.cfg}


def _tiny_gguf_model(folder: Path, tmp: Path, *, dense_copies: bool) -> dict[str, Any]:
    """The tiny model served from GGUF blocks (Q4_1 projections, Q8_0 embedding and head), float32; with
    ``dense_copies`` it keeps dense copies of every compact weight (``--dense-copies-mb -1``): a verification
    step's k + 1 rows then multiply by the copies, a plain step's one row by the kernels."""
    from support.gguf_files import write_tiny_gguf

    from service.model.load_gguf import load_gguf_model
    from service.model.weights.dense_copies import keep_dense_copies

    gguf = write_tiny_gguf(folder, tmp / "tiny.gguf", types={"token_embd": "Q8_0", "output.": "Q8_0"})
    model = load_gguf_model(folder, gguf, dtype=torch.float32)[0]
    if dense_copies:
        assert keep_dense_copies(model, None) > 0
    return {"dir": folder, "model": model, "cfg": model.cfg}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _tiny_gguf_model(tiny_llama_dir, tmp_path_factory.mktemp("medusa_gguf"), dense_copies=False)


@pytest.fixture(scope="module")
def tiny_gguf_dense(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _tiny_gguf_model(tiny_llama_dir, tmp_path_factory.mktemp("medusa_gguf_dense"), dense_copies=True)


@pytest.fixture(scope="module")
def predictable(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny Llama whose greedy text heads can learn, plus trained v2 heads for it written to a real folder."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("predictable")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_llama_dir / name, folder / name)
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    for key in tensors:
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[key] = tensors[key] * 0.12
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_ours(folder)
    prompts = prompts_for(model.cfg, 48, seed=11)
    plain = generate(model, prompts, 96, eos_token_ids=(EOS,))
    hidden = teacher_hidden(model, prompts, plain.tokens)
    x, y = head_dataset(hidden, plain.tokens, 3)
    weight, bias = train_v2_heads(
        x, y, model.lm_head, lengths=[len(t) for t in plain.tokens], mse_epochs=2, ce_epochs=3, batch_size=128, lr=3e-3
    )
    heads_dir = write_medusa(tmp_path_factory.mktemp("trained_heads"), weight, bias, version=2)
    spec = index_medusa(heads_dir, model.cfg)
    heads = MedusaHeads.load(spec, device="cpu", dtype=torch.float32)
    return {"dir": folder, "model": model, "heads": heads, "accuracy": head_accuracy(heads, x, y, model.lm_head)}


# --- format ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("explicit", [True, False])
def test_index_and_load_match_the_file(tiny: dict[str, Any], tmp_path: Path, version: int, explicit: bool) -> None:
    from safetensors.torch import load_file

    cfg = tiny["cfg"]
    folder = write_random_heads(tmp_path, cfg, version=version, n_heads=3, n_layers=2, explicit_version=explicit)
    spec = index_medusa(folder, cfg)
    assert (spec.version, spec.num_heads, spec.num_layers) == (version, 3, 2)
    assert spec.config.version == (version if explicit else None)
    assert is_medusa_folder(folder) and not is_medusa_folder(tiny["dir"])
    tensors = load_file(folder / "medusa_lm_head.safetensors")
    assert set(spec.records()) == set(tensors)
    assert spec.raw_nbytes() == sum(t.numel() * t.element_size() for t in tensors.values())

    heads = MedusaHeads.load(spec, device="cpu", dtype=torch.float32)
    assert heads.nbytes == spec.laid_out_nbytes(torch.float32)
    for h in range(3):
        for layer in range(2):
            torch.testing.assert_close(
                heads.block_weight[layer, h], tensors[f"{h}.{layer}.linear.weight"], rtol=0, atol=0
            )
            torch.testing.assert_close(heads.block_bias[layer, h], tensors[f"{h}.{layer}.linear.bias"], rtol=0, atol=0)
        if version == 1:
            assert heads.out_weight is not None
            torch.testing.assert_close(heads.out_weight[h], tensors[f"{h}.2.weight"], rtol=0, atol=0)


def reference_head_logits(
    folder: Path, x: torch.Tensor, lm_head: torch.Tensor, n_heads: int, n_layers: int
) -> torch.Tensor:
    """Medusa's own structure, head by head: ``n_layers`` x ResBlock(x + SiLU(Linear(x))), then a Linear."""
    from safetensors.torch import load_file

    t = load_file(folder / "medusa_lm_head.safetensors")
    out = []
    for h in range(n_heads):
        y = x
        for layer in range(n_layers):
            y = y + F.silu(y @ t[f"{h}.{layer}.linear.weight"].T + t[f"{h}.{layer}.linear.bias"])
        proj = t.get(f"{h}.{n_layers}.weight", lm_head)
        out.append(y @ proj.T)
    return torch.stack(out, dim=1)  # [B, n, V]


@pytest.mark.parametrize("version", [1, 2])
def test_heads_math_matches_reference_structure(tiny: dict[str, Any], tmp_path: Path, version: int) -> None:
    cfg, model = tiny["cfg"], tiny["model"]
    folder = write_random_heads(tmp_path, cfg, version=version, n_heads=4, n_layers=3, seed=5)
    heads = MedusaHeads.load(index_medusa(folder, cfg), device="cpu", dtype=torch.float32)
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    ref = reference_head_logits(folder, x, model.lm_head, 4, 3)
    torch.testing.assert_close(heads.logits(x, model.lm_head), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(heads.draft(x, model.lm_head), ref.argmax(-1))
    assert torch.equal(heads.topk(x, model.lm_head, 3), ref.topk(3, dim=-1).indices)
    ids, probs = heads.draft_with_confidence(x, model.lm_head)
    assert torch.equal(ids, ref.argmax(-1))
    torch.testing.assert_close(probs, torch.softmax(ref, dim=-1).amax(-1), rtol=1e-5, atol=1e-6)


def test_prefixed_names_and_lora_file_are_handled(tiny: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    cfg = tiny["cfg"]
    folder = write_random_heads(tmp_path, cfg, version=2)
    tensors = load_file(folder / "medusa_lm_head.safetensors")
    (folder / "medusa_lm_head.safetensors").unlink()
    save_file({f"medusa_head.{k}": v for k, v in tensors.items()}, folder / "heads.safetensors")
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(2, 2)}, folder / "adapter_model.safetensors")
    assert weight_files(folder) == (folder / "heads.safetensors",)
    spec = index_medusa(folder, cfg)
    assert spec.heads[0].blocks[0].weight.name == "medusa_head.0.0.linear.weight"
    assert spec.files == ((folder / "heads.safetensors").resolve(),)


def _expect_invalid(
    folder: Path, cfg: ModelConfig, *, file: str, words: Sequence[str], tensor: str | None = None
) -> None:
    with pytest.raises(InvalidAdapter) as info:
        index_medusa(folder, cfg)
    err = info.value
    assert err.file is not None and Path(err.file).name == file, str(err)
    assert file in str(err)
    for word in words:
        assert word in str(err), str(err)
    if tensor is not None:
        assert tensor in str(err)


def test_bad_heads_are_refused_by_name(tiny: dict[str, Any], tmp_path: Path) -> None:
    cfg = tiny["cfg"]
    h, v = cfg.hidden_size, cfg.vocab_size
    weights = "medusa_lm_head.safetensors"

    # wrong hidden size (v2 blocks for a 32-wide model)
    w, b, _ = random_heads(dataclasses.replace(cfg, hidden_size=32), n_heads=2, n_layers=1, version=2, seed=0)
    _expect_invalid(
        write_medusa(tmp_path / "hidden", w, b, version=2),
        cfg,
        file=weights,
        words=["shape (32, 32)", f"hidden_size={h}"],
        tensor="0.0.linear.weight",
    )
    # vocabulary mismatch of a v1 projection
    w, b, out = random_heads(cfg, n_heads=2, n_layers=1, version=1, seed=0, vocab=v + 7)
    _expect_invalid(
        write_medusa(tmp_path / "vocab", w, b, out, version=1),
        cfg,
        file=weights,
        words=[f"shape ({v + 7}, {h})", f"vocab_size={v}"],
    )
    # missing config keys
    folder = write_random_heads(tmp_path / "keys", cfg, version=2)
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 3}))
    _expect_invalid(folder, cfg, file="config.json", words=["medusa_num_layers"])
    # head count 0
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 0, "medusa_num_layers": 1}))
    _expect_invalid(folder, cfg, file="config.json", words=["medusa_num_heads must be an integer >= 1"])
    # bad version
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1, "version": 3}))
    _expect_invalid(folder, cfg, file="config.json", words=["version must be 1 or 2"])
    # not JSON
    (folder / "config.json").write_text("{oops")
    _expect_invalid(folder, cfg, file="config.json", words=["cannot read JSON"])
    # corrupt safetensors: a garbage header, then a truncated data section
    folder = write_random_heads(tmp_path / "corrupt", cfg, version=2)
    data = (folder / weights).read_bytes()
    (folder / weights).write_bytes(data[:8] + b"[not json" + data[17:])
    _expect_invalid(folder, cfg, file=weights, words=["not a valid safetensors file"])
    (folder / weights).write_bytes(data[: len(data) // 2])
    _expect_invalid(folder, cfg, file=weights, words=["not a valid safetensors file"])
    # the config promises more heads than the file holds
    folder = write_random_heads(tmp_path / "missing", cfg, version=2, n_heads=2)
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    _expect_invalid(folder, cfg, file=weights, words=["missing", "'2.0.linear.weight'", "'2.0.linear.bias'"])
    # and fewer: the extra head is named
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    _expect_invalid(folder, cfg, file=weights, words=["head 1 is beyond"], tensor="1.0.linear.weight")
    # v2 declared but the file has v1 projections
    folder = write_random_heads(tmp_path / "v1as2", cfg, version=1)
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1, "version": 2}))
    _expect_invalid(folder, cfg, file=weights, words=["version 2 heads use the base model's lm_head"])
    # v1 declared, projections absent
    folder = write_random_heads(tmp_path / "v2as1", cfg, version=2)
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1, "version": 1}))
    _expect_invalid(folder, cfg, file=weights, words=["'0.1.weight'"])
    # a foreign tensor
    from safetensors.torch import load_file, save_file

    folder = write_random_heads(tmp_path / "foreign", cfg, version=2)
    tensors = load_file(folder / weights)
    save_file({**tensors, "lm_head.weight": torch.zeros(v, h)}, folder / weights)
    _expect_invalid(folder, cfg, file=weights, words=["not a Medusa head tensor"], tensor="lm_head.weight")
    # integer weights
    save_file({**tensors, "0.0.linear.bias": torch.zeros(h, dtype=torch.int32)}, folder / weights)
    _expect_invalid(folder, cfg, file=weights, words=["dtype I32 is not a float type"])
    # pickles only, and no weights at all
    (folder / weights).unlink()
    (folder / "medusa_lm_head.pt").write_bytes(b"pickle")
    _expect_invalid(folder, cfg, file="medusa_lm_head.pt", words=["pickled", "safetensors"])
    (folder / "medusa_lm_head.pt").unlink()
    _expect_invalid(folder, cfg, file=folder.name, words=["no medusa_lm_head.safetensors"])


def test_read_config_fields(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "medusa_num_heads": 4,
                "medusa_num_layers": 1,
                "version": 2.0,
                "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
            }
        )
    )
    cfg = read_medusa_config(path)
    assert (cfg.num_heads, cfg.num_layers, cfg.version) == (4, 1, 2)
    assert cfg.base_model_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    path.write_text(json.dumps({"medusa_num_heads": True, "medusa_num_layers": 1}))
    with pytest.raises(InvalidAdapter, match="medusa_num_heads"):
        read_medusa_config(path)
    path.write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 0, "version": 2}))
    with pytest.raises(InvalidAdapter, match="version 2"):
        read_medusa_config(path)


# --- verification ------------------------------------------------------------------------------------------


def brute_force_greedy(draft: list[int], logits: torch.Tensor, cap: int) -> list[int]:
    """One row, one token at a time: keep drafts while they equal the argmax, then emit the argmax."""
    out = []
    for i in range(cap):
        target = int(logits[i].argmax())
        if draft[i] != target:
            return [*out, target]
        out.append(draft[i])
    return [*out, int(logits[cap].argmax())]


def test_verify_greedy_against_brute_force() -> None:
    g = torch.Generator().manual_seed(0)
    b, k, v = 64, 4, 11
    logits = torch.randn(b, k + 1, v, generator=g)
    target = logits.argmax(-1)
    # drafts right with probability 0.6 each, so every acceptance length occurs
    wrong = (target[:, :k] + torch.randint(1, v, (b, k), generator=g)) % v
    draft = torch.where(torch.rand(b, k, generator=g) < 0.6, target[:, :k], wrong)
    caps = torch.randint(0, k + 1, (b,), generator=g)
    for num_drafts in (None, caps):
        res = verify_greedy(draft, logits, num_drafts)
        seen = set()
        for row in range(b):
            cap = k if num_drafts is None else int(caps[row])
            expect = brute_force_greedy(draft[row].tolist(), logits[row], cap)
            a = int(res.accepted[row])
            assert a == len(expect) - 1
            assert res.tokens[row, : a + 1].tolist() == expect
            assert (res.tokens[row, a + 1 :] == PAD).all()
            seen.add(a)
        assert seen == set(range(k + 1))
    assert torch.equal(verify_greedy(draft, logits).emitted, verify_greedy(draft, logits).accepted + 1)
    with pytest.raises(ValueError):
        verify_greedy(draft, logits[:, :k])


def test_verify_sampling_with_one_hot_targets_is_greedy() -> None:
    g = torch.Generator().manual_seed(3)
    b, k, v = 32, 3, 9
    logits = torch.randn(b, k + 1, v, generator=g)
    target = logits.argmax(-1)
    draft = torch.where(torch.rand(b, k, generator=g) < 0.7, target[:, :k], (target[:, :k] + 1) % v)
    one_hot = F.one_hot(target, v).double()
    gens = [torch.Generator().manual_seed(i) for i in range(b)]
    got, want = verify_sampling(draft, one_hot, gens), verify_greedy(draft, logits)
    assert torch.equal(got.accepted, want.accepted) and torch.equal(got.tokens, want.tokens)


def test_rejection_sampling_preserves_the_distribution() -> None:
    """k = 2 drafts, V = 5. Uniforms on a stratified grid (every combination of 24 acceptance levels per draft and
    96 final-draw levels), so the frequency of every emitted prefix converges to its exact probability to within
    the grid's resolution: P(y1) = p0(y1); P(y1 = d1, y2) = p0(d1) p1(y2); P(d1, d2, y3) = p0(d1) p1(d2) p2(y3)."""
    p = torch.tensor(
        [[0.40, 0.25, 0.15, 0.12, 0.08], [0.05, 0.50, 0.30, 0.10, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64
    )  # [k+1, V]: p_i for the step after the pending token and the first i drafts
    d = [0, 1]  # drafts: the first is p0's mode, the second p1's
    na, nf = 24, 96
    grid_a = (torch.arange(na, dtype=torch.float64) + 0.5) / na
    grid_f = (torch.arange(nf, dtype=torch.float64) + 0.5) / nf
    u1, u2, uf = torch.meshgrid(grid_a, grid_a, grid_f, indexing="ij")
    u = torch.stack([u1.reshape(-1), u2.reshape(-1), uf.reshape(-1)], dim=1)  # [N, 3]
    n = u.shape[0]
    res = verify_sampling(torch.tensor([d] * n), p[None].expand(n, 3, 5), u)
    toks = res.tokens.tolist()
    first = torch.tensor([t[0] for t in toks])
    freq1 = torch.bincount(first, minlength=5).double() / n
    torch.testing.assert_close(freq1, p[0], rtol=0, atol=0.02)
    after_d1 = [t[1] for t in toks if t[0] == d[0]]
    freq2 = torch.bincount(torch.tensor(after_d1), minlength=5).double() / n
    torch.testing.assert_close(freq2, p[0, d[0]] * p[1], rtol=0, atol=0.02)
    after_d2 = [t[2] for t in toks if t[0] == d[0] and t[1] == d[1]]
    freq3 = torch.bincount(torch.tensor(after_d2), minlength=5).double() / n
    torch.testing.assert_close(freq3, p[0, d[0]] * p[1, d[1]] * p[2], rtol=0, atol=0.02)


def test_rejection_sampling_chi_square_with_generators() -> None:
    """Random per-row generators, a draft that is not the mode, and rows capped at 0 drafts (plain sampling)."""
    g = torch.Generator().manual_seed(7)
    v, n = 6, 20000
    p0 = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64), 0)
    p1 = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64), 0)
    probs = torch.stack([p0, p1])[None].expand(n, 2, v)
    draft = torch.full((n, 1), int(p0.argmin()))
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    caps = torch.tensor([i % 2 for i in range(n)])
    res = verify_sampling(draft, probs, gens, caps)
    for rows in (caps == 1, caps == 0):
        first = res.tokens[rows, 0]
        observed = torch.bincount(first, minlength=v).double()
        expected = p0 * rows.sum()
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < 25.0, (chi2, observed, expected)  # 5 d.o.f.: p ~ 1e-4
    assert (res.accepted[caps == 0] == 0).all()


# --- the loop ----------------------------------------------------------------------------------------------


# The compact bases' runs are the numerics subset (make test reruns them under every CPU capability).
COMPACT = [pytest.param(b, marks=pytest.mark.numerics) for b in ("tiny_int4", "tiny_gguf", "tiny_gguf_dense")]


@pytest.mark.parametrize("base", ["tiny", *COMPACT])
def test_plain_loop_matches_reference_greedy(request: pytest.FixtureRequest, base: str) -> None:
    model = request.getfixturevalue(base)["model"]
    prompts = prompts_for(model.cfg, 4, seed=3)
    out = generate(model, prompts, 40, eos_token_ids=(EOS,))
    assert out.tokens == [greedy_generate(model, p, 40, eos_token_ids=(EOS,)) for p in prompts]
    assert out.stats.mean_accepted_length == 1.0 and out.stats.drafted == 0


@pytest.mark.parametrize("base", ["tiny", "tiny_int4", "tiny_gguf", "tiny_gguf_dense"])
@pytest.mark.parametrize("version", [1, pytest.param(2, marks=pytest.mark.numerics)])
def test_random_heads_speculation_is_token_identical(
    request: pytest.FixtureRequest, tmp_path: Path, version: int, base: str
) -> None:
    """24 prompts x 128 new tokens: alone, and in one batch mixing these heads, other heads and none."""
    model, cfg = request.getfixturevalue(base)["model"], request.getfixturevalue(base)["cfg"]
    heads = MedusaHeads.load(
        index_medusa(write_random_heads(tmp_path / "a", cfg, version=version, n_heads=3), cfg),
        device="cpu",
        dtype=torch.float32,
    )
    other = MedusaHeads.load(
        index_medusa(write_random_heads(tmp_path / "b", cfg, version=3 - version, n_heads=2, n_layers=2, seed=9), cfg),
        device="cpu",
        dtype=torch.float32,
    )
    prompts = prompts_for(cfg, 24, seed=version)
    plain = generate(model, prompts, 128, eos_token_ids=(EOS,))
    for i in range(0, 24, 6):  # alone (a few rows; the mixed batch covers all 24)
        assert generate(model, [prompts[i]], 128, heads=heads, eos_token_ids=(EOS,)).tokens == [plain.tokens[i]]
    mixed = [heads, None, other][:3] * 8
    spec = generate(model, prompts, 128, heads=mixed, eos_token_ids=(EOS,))
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0


def test_trained_heads_accept_partially_and_stay_identical(predictable: dict[str, Any]) -> None:
    model, heads = predictable["model"], predictable["heads"]
    assert min(predictable["accuracy"]) > 0.3, predictable["accuracy"]
    prompts = prompts_for(model.cfg, 24, seed=99)  # not the training prompts
    plain = generate(model, prompts, 128, eos_token_ids=(EOS,))
    spec = generate(model, prompts, 128, heads=heads, eos_token_ids=(EOS,))
    assert spec.tokens == plain.tokens
    s = spec.stats
    assert s.mean_accepted_length > 1.5, s
    assert 0.2 < s.acceptance_rate < 0.95, s  # many partial accepts, not all-or-nothing
    assert s.steps < plain.stats.steps
    mixed = generate(model, prompts, 128, heads=[heads, None] * 12, eos_token_ids=(EOS,))
    assert mixed.tokens == plain.tokens
    # only confident drafts verified: fewer drafts, the same tokens
    gated = generate(model, prompts, 128, heads=heads, eos_token_ids=(EOS,), draft_threshold=0.5)
    assert gated.tokens == plain.tokens
    assert 0 < gated.stats.drafted < s.drafted and gated.stats.acceptance_rate > s.acceptance_rate
    # switched off above the batch size: plain steps only
    off = generate(model, prompts, 128, heads=heads, eos_token_ids=(EOS,), speculate_max_batch=4)
    assert off.tokens == plain.tokens
    assert off.stats.drafted < s.drafted  # only once at most 4 rows are left, if ever
    never = generate(model, prompts[:4], 32, heads=heads, eos_token_ids=(EOS,), speculate_max_batch=0)
    assert never.stats.drafted == 0 and never.tokens == [t[:32] for t in plain.tokens[:4]]


def test_recorded_hidden_states_match_teacher_forcing(predictable: dict[str, Any]) -> None:
    """The states the loop records while decoding (plain and speculative) equal a teacher-forced pass's."""
    model, heads = predictable["model"], predictable["heads"]
    prompts = prompts_for(model.cfg, 6, seed=8)
    for h in (None, heads):
        out = generate(model, prompts, 40, heads=h, eos_token_ids=(EOS,), record_hidden=True)
        assert out.hidden is not None
        for got, want in zip(out.hidden, teacher_hidden(model, prompts, out.tokens), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_kv_cache_is_consistent_after_partial_accepts(predictable: dict[str, Any]) -> None:
    """After a speculative run, the cache holds exactly the K/V a fresh prefill of the kept tokens writes."""
    model, heads = predictable["model"], predictable["heads"]
    prompt = prompts_for(model.cfg, 1, seed=5)[0]
    cache = KVCache(model.cfg, 1, 256, dtype=torch.float32, device=torch.device("cpu"))
    out = generate(model, [prompt], 100, heads=heads, cache=cache)  # the row stays in slot 0 when it finishes
    tokens = out.tokens[0]
    assert out.stats.accepted > 10 and out.stats.drafted > out.stats.accepted
    # Every emitted token but the last was fed (and so were drafts accepted past the max_new_tokens cut).
    kept = len(prompt) + len(tokens) - 1
    fresh = KVCache(model.cfg, 1, kept, dtype=torch.float32, device=torch.device("cpu"))
    seq = torch.tensor([(prompt + tokens)[:kept]])
    model(seq, torch.arange(kept)[None], fresh, 0)
    for layer in range(model.cfg.num_layers):
        torch.testing.assert_close(cache.k[layer][0, :, :kept], fresh.k[layer][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[layer][0, :, :kept], fresh.v[layer][0], rtol=1e-5, atol=1e-5)


def test_medusa_with_lora_rows(predictable: dict[str, Any], tmp_path: Path) -> None:
    """Medusa + LoRA: heads and a peft-written LoRA on the same rows, next to base rows and LoRA-only rows."""
    from support.adapter_files import lookup_for, peft_lora_layers, write_peft_adapter

    from service.adapters.lora.batch import AdapterBatch, LoraTables

    model, heads = predictable["model"], predictable["heads"]
    lora_dir = write_peft_adapter(
        tmp_path / "lora",
        predictable["dir"],
        r=4,
        alpha=8,
        scale=0.3,
        seed=3,
        target_modules=("q_proj", "v_proj", "down_proj"),
    )
    layers = {"lora": peft_lora_layers(lora_dir)}
    prompts = prompts_for(model.cfg, 12, seed=21)
    row_adapter = ["lora", None, "lora"] * 4
    row_heads = [heads, heads, None] * 4

    def hooks() -> Any:
        tables = LoraTables(model.cfg, device="cpu", dtype=torch.float32)
        return lambda rows: AdapterBatch.build([row_adapter[r] for r in rows], lookup_for(layers), tables)

    plain = generate(model, prompts, 128, eos_token_ids=(EOS,), adapters=hooks())
    base = generate(model, prompts, 128, eos_token_ids=(EOS,))
    assert plain.tokens[0] != base.tokens[0]  # the LoRA changes the text, so the comparison below means something
    spec = generate(model, prompts, 128, heads=row_heads, eos_token_ids=(EOS,), adapters=hooks())
    assert spec.tokens == plain.tokens
    assert spec.stats.accepted > 0
