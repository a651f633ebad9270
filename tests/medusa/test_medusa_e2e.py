"""Medusa served end to end: speculative greedy output equals plain greedy, alone and in mixed batches."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
from loraplex import Client, InvalidArgument
from support.adapter_files import write_peft_adapter
from support.paths import ROOT
from support.servers import tiny_settings

from service import metrics
from service.adapters.medusa.format import write_medusa
from service.api.server import BackgroundServer
from service.model.config import ModelConfig

PROMPTS = [f"Prompt number {i}: tell me about item {i * 7}" for i in range(20)]
NEW_TOKENS = 128
DEMO = ROOT / "adapters" / "demo"


def random_heads(folder: Path, cfg: ModelConfig, *, version: int, n_heads: int = 3, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    weight = torch.randn(1, n_heads, h, h, generator=g) * 0.05
    bias = torch.randn(1, n_heads, h, generator=g) * 0.05
    out = torch.randn(n_heads, cfg.vocab_size, h, generator=g) if version == 1 else None
    return write_medusa(folder, weight, bias, out, version=version)


@pytest.fixture(scope="module")
def roots(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("medusa_adapters")
    cfg = ModelConfig.from_hf(served_tiny_dir)
    random_heads(root / "v1", cfg, version=1, seed=1)
    random_heads(root / "v2", cfg, version=2, seed=2)
    write_peft_adapter(root / "lora", served_tiny_dir, r=4, alpha=8, seed=5, scale=0.5)
    shutil.copytree(root / "lora", root / "both")
    random_heads(root / "both", cfg, version=2, n_heads=4, seed=3)  # Medusa + LoRA in one folder
    return root


SETTINGS: dict[str, object] = {
    "max_batch_size": 32,
    "max_queue": 256,
    "speculate_max_batch": 32,
    "speculate_adaptive": False,  # these tests exercise the speculative path itself, whatever it costs here
}


@pytest.fixture(scope="module")
def server_settings(roots: Path) -> dict[str, object]:
    return {**SETTINGS, "adapter_dirs": (roots,)}


def run_all(target: str, jobs: list[tuple[str, str | None, bool | None]]) -> list[tuple[list[int], int]]:
    """Each (prompt, adapter, speculate) at once (one mixed batch); token ids and accepted draft counts."""
    out: list[tuple[list[int], int]] = [([], 0)] * len(jobs)
    with Client(target, timeout=300) as client:

        def one(i: int) -> None:
            prompt, adapter, speculate = jobs[i]
            g = client.generate(
                prompt,
                adapter=adapter,
                speculate=speculate,
                max_new_tokens=NEW_TOKENS,
                ignore_eos=True,
                return_token_ids=True,
            )
            out[i] = (list(g.token_ids), g.usage.accepted_draft_tokens)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    return out


def test_kinds_are_reported(server: BackgroundServer) -> None:
    with Client(server.target, timeout=30) as client:
        kinds = {a.id: (a.kind.value, a.medusa_heads) for a in client.list_adapters()}
    assert kinds == {"v1": ("medusa", 3), "v2": ("medusa", 3), "lora": ("lora", 0), "both": ("medusa_lora", 4)}


def test_speculative_greedy_equals_plain_alone(server: BackgroundServer) -> None:
    """20 prompts x 128 tokens with only Medusa rows in the batch (v1, then v2) equal plain greedy."""
    plain = run_all(server.target, [(p, None, None) for p in PROMPTS])
    for adapter in ("v1", "v2"):
        spec = run_all(server.target, [(p, adapter, None) for p in PROMPTS])
        for i, ((got, _), (want, _)) in enumerate(zip(spec, plain, strict=True)):
            assert got == want, f"{adapter} prompt {i}"


def test_speculative_greedy_equals_plain_in_mixed_batches(server: BackgroundServer) -> None:
    """20 prompts x 128 tokens: v1, v2 and Medusa + LoRA rows batched with base and LoRA-only rows."""
    adapters = ["v1", "v2", "both", None, "lora"]
    jobs = [(p, adapters[i % len(adapters)], None) for i, p in enumerate(PROMPTS)]
    mixed = run_all(server.target, jobs)
    reference_jobs = []
    for prompt, adapter, _ in jobs:
        # Heads never change greedy output: the reference is the same prompt without speculation.
        reference_jobs.append((prompt, "lora" if adapter in ("both", "lora") else None, None))
    reference = run_all(server.target, reference_jobs)
    for i, ((got, _), (want, _)) in enumerate(zip(mixed, reference, strict=True)):
        assert got == want, f"row {i} adapter={jobs[i][1]}"
        assert len(got) == NEW_TOKENS
    assert jobs[2][1] == "both"
    off = run_all(server.target, [(PROMPTS[2], "both", False)])
    assert off[0] == (mixed[2][0], 0)  # speculate=false: same tokens, no drafts


TREE = "0;1;2;0.0;0.1;1.0;2.0;0.0.0;0.1.0;1.0.0;0.0.0.0"


def test_tree_speculation_equals_plain_in_mixed_batches(served_tiny_dir: Path, roots: Path) -> None:
    """With a draft tree (3 and 4 heads: the 4-head adapter uses the deepest node too): v1, v2, Medusa + LoRA rows
    batched with base and LoRA rows, alone and mixed, equal plain greedy."""
    adapters = ["v1", "v2", "both", None, "lora"]
    jobs = [(p, adapters[i % len(adapters)], None) for i, p in enumerate(PROMPTS)]
    with BackgroundServer(tiny_settings(served_tiny_dir, SETTINGS, adapter_dirs=(roots,), speculate_tree=TREE)) as srv:
        before = metrics.SPECULATIVE_ACCEPTED._value.get()
        mixed = run_all(srv.target, jobs)
        alone = run_all(srv.target, [(p, "v2", None) for p in PROMPTS[:6]])
        accepted = metrics.SPECULATIVE_ACCEPTED._value.get() - before
        reference = run_all(srv.target, [(p, "lora" if a in ("both", "lora") else None, False) for p, a, _ in jobs])
        plain = run_all(srv.target, [(p, None, None) for p in PROMPTS[:6]])
    for i, ((got, _), (want, _)) in enumerate(zip(mixed, reference, strict=True)):
        assert got == want, f"row {i} adapter={jobs[i][1]}"
    assert [t for t, _ in alone] == [t for t, _ in plain]
    assert accepted > 0


def test_adaptive_speculation_keeps_output(served_tiny_dir: Path, roots: Path) -> None:
    """The server's default: the governor tries speculative and plain steps and keeps the faster; output is plain."""
    with BackgroundServer(
        tiny_settings(served_tiny_dir, SETTINGS, adapter_dirs=(roots,), speculate_adaptive=True, speculate_tree=TREE)
    ) as srv:
        before = metrics.SPECULATIVE_STEPS._value.get()
        got = run_all(srv.target, [(p, "v2", None) for p in PROMPTS[:8]])
        steps = metrics.SPECULATIVE_STEPS._value.get() - before
        plain = run_all(srv.target, [(p, None, None) for p in PROMPTS[:8]])
    assert [t for t, _ in got] == [t for t, _ in plain]
    assert steps >= 8  # it measured speculation before deciding


def test_speculate_true_without_heads_is_invalid(server: BackgroundServer) -> None:
    with Client(server.target, timeout=30) as client:
        with pytest.raises(InvalidArgument, match="Medusa"):
            client.generate("x", adapter="lora", speculate=True, max_new_tokens=2)
        with pytest.raises(InvalidArgument, match="Medusa"):
            client.generate("x", speculate=True, max_new_tokens=2)


def test_bad_heads_are_refused_and_the_server_keeps_serving(
    server: BackgroundServer, roots: Path, served_tiny_dir: Path
) -> None:
    cfg = ModelConfig.from_hf(served_tiny_dir)
    bad = roots / "bad-hidden"
    g = torch.Generator().manual_seed(0)
    write_medusa(
        bad,
        torch.randn(1, 2, cfg.hidden_size + 1, cfg.hidden_size + 1, generator=g),
        torch.zeros(1, 2, cfg.hidden_size + 1),
    )
    with Client(server.target, timeout=30) as client:
        with pytest.raises(InvalidArgument, match=r"medusa_lm_head\.safetensors"):
            client.load_adapter("bad-hidden", bad)
        assert client.generate("still fine", max_new_tokens=3, ignore_eos=True).usage.generated_tokens == 3


def test_draft_threshold_gates_drafts_and_keeps_output(served_tiny_dir: Path, roots: Path) -> None:
    """A high threshold verifies few of the random heads' drafts (1.7 % here), a tiny one every draft; either way
    the output is plain greedy."""
    plain = None
    drafted = {}
    for threshold in (0.999, 1e-12):
        with BackgroundServer(
            tiny_settings(served_tiny_dir, SETTINGS, adapter_dirs=(roots,), draft_threshold=threshold)
        ) as srv:
            before = metrics.SPECULATIVE_DRAFTED._value.get()
            got = run_all(srv.target, [(p, "v2", None) for p in PROMPTS[:4]])
            drafted[threshold] = metrics.SPECULATIVE_DRAFTED._value.get() - before
            if plain is None:
                plain = run_all(srv.target, [(p, None, None) for p in PROMPTS[:4]])
        assert [t for t, _ in got] == [t for t, _ in plain]
    assert drafted[0.999] < drafted[1e-12] / 10


@pytest.mark.slow
def test_trained_demo_heads_accept_and_stay_identical(smollm2_dir: Path) -> None:
    if not (DEMO / "medusa" / "config.json").is_file():
        pytest.fail("adapters/demo/medusa is missing: run scripts/train_medusa_heads.py")
    settings = tiny_settings(
        smollm2_dir, SETTINGS, adapter_dirs=(DEMO,), max_batch_size=8, speculate_max_batch=8, max_total_tokens=1024
    )
    questions = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?", "What is 2+2?"]
    accepted = 0
    with BackgroundServer(settings) as srv, Client(srv.target, timeout=300) as client:
        for q in questions:
            spec = client.generate(q, chat=True, adapter="medusa", max_new_tokens=64, return_token_ids=True)
            plain = client.generate(q, chat=True, max_new_tokens=64, return_token_ids=True)
            assert spec.token_ids == plain.token_ids
            accepted += spec.usage.accepted_draft_tokens
    assert accepted > 0  # drafts were verified and some kept (the KV cache survived partial accepts)
