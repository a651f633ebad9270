"""The prompt-lookup drafter (``--draft prompt-lookup``): its matching, and greedy output identical to plain decoding.

On a tiny random model (alone, and in batches with sampled rows) and on the real SmolLM2 with a repetitive prompt,
where it must also be accepted often. A drafter registered by the test itself shows the seam: rows of Medusa heads
and rows of another drafter, each with its own tree, verified in one step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.drafters import Oracle
from support.engines import prompt, req, run, stepped_engine, tokens_of

from service import metrics
from service.adapters.catalog import AdapterCatalog
from service.adapters.lora.part import LoraPart
from service.adapters.lora.store import AdapterStore
from service.adapters.medusa.format import write_medusa
from service.adapters.medusa.part import MedusaPart
from service.adapters.medusa.registry import MedusaRegistry
from service.config import Settings
from service.drafters.prompt_lookup import PromptLookupDrafter, lookup
from service.drafters.registry import SERVER_DRAFTERS
from service.engine.engine import Engine
from service.engine.runner import Runner
from service.engine.sampling import SamplingParams
from service.model.config import ModelConfig
from service.model.load_folder import load_model
from service.tokenizer import Tokenizer

CPU = torch.device("cpu")
DRAFT = {"draft": "prompt-lookup", "speculate_adaptive": False, "speculate_max_batch": 16, "max_batch_size": 16}


def _counted() -> tuple[float, float]:
    return metrics.SPECULATIVE_DRAFTED._value.get(), metrics.SPECULATIVE_ACCEPTED._value.get()


def test_lookup_proposes_what_followed_the_latest_earlier_match() -> None:
    assert lookup([1, 2, 3, 4, 1, 2, 3], 3, 4) == (4, 1, 2, 3)
    assert lookup([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 3, 2) == (8, 1)  # the most recent match wins
    assert lookup([5, 1, 2, 7, 2], 3, 3) == (7, 2)  # no 3- or 2-token match: the last token alone
    assert lookup([1, 2, 3, 4, 5], 3, 4) == ()
    assert lookup([7], 3, 3) == () and lookup([], 3, 3) == ()
    assert lookup([256, 1, 0, 1], 1, 2) == (0, 1)  # matches are whole tokens, never bytes across two


def test_the_drafter_proposes_a_chain_of_at_most_its_tokens() -> None:
    drafter = PromptLookupDrafter(ngram=2, tokens=3)
    drafts = drafter.propose(torch.zeros(2, 4), [[1, 2, 3, 4, 5, 1, 2], [1, 2, 3]], None)  # type: ignore[arg-type]
    assert drafts[1] is None
    assert drafts[0] is not None and drafts[0].tokens == (3, 4, 5) and drafts[0].tree.paths == ((0,), (0, 0), (0, 0, 0))
    with pytest.raises(ValueError):
        PromptLookupDrafter(ngram=0, tokens=3)


def test_settings_refuse_an_unknown_drafter() -> None:
    with pytest.raises(ValueError, match="draft must be none or one of"):
        Settings(draft="eagle").validate()
    with pytest.raises(ValueError, match="draft_ngram"):
        Settings(draft="prompt-lookup", draft_tokens=0).validate()


def _jobs() -> list[tuple[str, list[int], dict[str, object]]]:
    looped = prompt(1, 12) * 4  # repeats itself: drafts from the first step
    return [
        ("looped", looped, {}),
        ("random", prompt(2, 30), {}),
        ("sampled", looped, {"sampling": SamplingParams(temperature=0.9, seed=7)}),
        ("off", looped, {"speculate": False}),
        ("long", prompt(3, 5) * 10, {}),
    ]


@pytest.mark.numerics
def test_greedy_output_with_prompt_lookup_is_plain_greedy_on_a_tiny_model(served_tiny_dir: Path) -> None:
    plain = stepped_engine(served_tiny_dir, **{**DRAFT, "draft": "none"})
    drafting = stepped_engine(served_tiny_dir, **DRAFT)
    expected = {rid: tokens_of(run(plain, req(rid, p, n=48, **kw))[rid]) for rid, p, kw in _jobs()}
    before = _counted()
    together = run(drafting, *(req(rid, p, n=48, **kw) for rid, p, kw in _jobs()))  # one mixed batch
    drafted, accepted = (a - b for a, b in zip(_counted(), before, strict=True))
    assert {rid: tokens_of(events) for rid, events in together.items()} == expected
    assert drafted > 0 and accepted > 0
    assert together["off"][-1].accepted_draft_tokens == 0 and together["sampled"][-1].accepted_draft_tokens == 0
    for rid, p, kw in _jobs()[:2]:  # and alone
        assert tokens_of(run(drafting, req(f"{rid}-alone", p, n=48, **kw))[f"{rid}-alone"]) == expected[rid]


def _medusa_engine(folder: Path, root: Path, **overrides: object) -> Engine:
    settings = Settings(model=folder, dtype="float32", **{**DRAFT, **overrides})  # type: ignore[arg-type]
    model, cfg, _ = load_model(folder, dtype=torch.float32, device=CPU)
    store = AdapterStore(cfg, device=CPU, dtype=torch.float32, device_budget_bytes=1 << 24, host_budget_bytes=1 << 24)
    registry = MedusaRegistry(cfg, device=CPU, dtype=torch.float32)
    catalog = AdapterCatalog([MedusaPart(registry, tree="0;1;0.0;1.0"), LoraPart(store)])
    catalog.register("heads", root)
    deadline = time.monotonic() + 30
    while not registry.request("heads"):  # the heads load on the registry's thread
        assert registry.failure("heads") is None and time.monotonic() < deadline
        time.sleep(0.01)
    return Engine(model, Tokenizer.from_folder(folder), settings, adapters=catalog)


@pytest.mark.numerics
def test_rows_of_medusa_heads_and_another_drafter_verify_their_own_trees_in_one_step(
    served_tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = ModelConfig.from_hf(served_tiny_dir)
    g = torch.Generator().manual_seed(4)
    h = cfg.hidden_size
    write_medusa(tmp_path / "heads", torch.randn(1, 2, h, h, generator=g) * 0.05, torch.zeros(1, 2, h), version=2)
    plain = _medusa_engine(served_tiny_dir, tmp_path / "heads", draft="none", speculate_max_batch=0)
    jobs = [(f"heads-{i}", prompt(10 + i, 12) * 3, {"adapter_id": "heads"}) for i in range(2)] + _jobs()[:2]
    expected = {rid: tokens_of(run(plain, req(rid, p, n=40, **kw))[rid]) for rid, p, kw in jobs}
    oracle = Oracle({tuple(p): expected[rid] for rid, p, _ in jobs})
    monkeypatch.setitem(SERVER_DRAFTERS, "oracle", lambda settings: oracle)
    steps: list[int] = []
    verify = Runner._tree_of_step

    def spy(self: Runner, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        depths, mask = verify(self, *args)
        steps.append(mask.dim())
        return depths, mask

    monkeypatch.setattr(Runner, "_tree_of_step", spy)
    mixed = _medusa_engine(served_tiny_dir, tmp_path / "heads", draft="oracle")
    together = run(mixed, *(req(rid, p, n=40, **kw) for rid, p, kw in jobs))
    assert {rid: tokens_of(events) for rid, events in together.items()} == expected
    assert together["looped"][-1].accepted_draft_tokens >= 20 and together["random"][-1].accepted_draft_tokens >= 20
    assert 3 in steps  # steps where each row had its own tree ([B, T, T] masks)


REPEAT = (
    "Repeat this list exactly, one item per line, and say nothing else:\n"
    "- def parse_header(path: Path) -> Header:\n- def read_tensor(record: TensorRecord) -> Tensor:\n"
    "- def check_finite(tensor: Tensor, name: str) -> None:\n- def open_verified(path: Path) -> int:\n"
    "- def resolve_source(path: Path, roots: Sequence[Path]) -> Path:\n"
)


@pytest.mark.slow
def test_greedy_output_with_prompt_lookup_is_plain_greedy_on_smollm2(smollm2_dir: Path) -> None:
    tok = Tokenizer.from_folder(smollm2_dir)
    ids = tok.encode_chat([{"role": "user", "content": REPEAT}])
    plain = stepped_engine(smollm2_dir, max_batch_size=4)
    drafting = stepped_engine(smollm2_dir, **{**DRAFT, "max_batch_size": 4})
    expected = tokens_of(run(plain, req("plain", ids, n=96))["plain"])
    before = _counted()
    events = run(drafting, req("drafted", ids, n=96))["drafted"]
    drafted, accepted = (a - b for a, b in zip(_counted(), before, strict=True))
    assert tokens_of(events) == expected
    assert accepted >= 0.4 * 96 and accepted <= drafted  # most of the answer is copied from the prompt
