"""Chunked prefill (``--prefill-chunk-tokens``) on stepped engines over real model files.

A long prompt is prefilled one chunk per step while the running rows decode a token each step; greedy output is
the same as with whole-prompt prefill (tiny model and the real SmolLM2; prompts of many chunks; LoRA and Medusa +
LoRA rows; a prefix-cache hit that ends inside a chunk). A row cancelled mid-prefill frees its slot, and a pass
that raises fails its rows only: a failing chunk leaves the running rows decoding, unchanged, and a failing decode
step leaves the row mid-prefill to finish its prompt.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapter_files import write_peft_adapter
from support.engines import Events, generate, idle, prompt, req, run, step_until, stepped_engine, tokens_of

from service import metrics
from service.adapters.catalog import AdapterCatalog
from service.adapters.lora.part import LoraPart
from service.adapters.lora.store import AdapterStore
from service.adapters.medusa.format import write_medusa
from service.adapters.medusa.part import MedusaPart
from service.adapters.medusa.registry import MedusaRegistry
from service.cli import build_parser, serve_settings
from service.config import ConfigError, Settings
from service.engine.engine import Engine
from service.engine.request import FinishReason
from service.errors import EngineStepFailed
from service.model.config import ModelConfig
from service.model.load_folder import load_model
from service.tokenizer import Tokenizer

CPU = torch.device("cpu")
CHUNK = 16
LIMITS = {"max_batch_size": 8, "max_total_tokens": 512, "max_prompt_tokens": 400, "prefix_block_tokens": 8}


def counter(metric: Any) -> float:
    return float(metric._value.get())


@pytest.fixture(scope="module")
def adapter_root(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chunked_adapters")
    cfg = ModelConfig.from_hf(served_tiny_dir)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    write_peft_adapter(root / "lora", served_tiny_dir, r=4, alpha=8, target_modules=targets, seed=5, scale=0.5)
    shutil.copytree(root / "lora", root / "both")
    g = torch.Generator().manual_seed(3)
    h = cfg.hidden_size
    weight, bias = torch.randn(1, 3, h, h, generator=g) * 0.05, torch.randn(1, 3, h, generator=g) * 0.05
    write_medusa(root / "both", weight, bias, None, version=2)  # Medusa heads + LoRA in one folder
    return root


def adapter_engine(folder: Path, root: Path, chunk: int) -> Engine:
    """A stepped engine with the adapters ``lora`` and ``both`` (Medusa + LoRA) resident before the first step."""
    settings = Settings(
        model=folder, prefill_chunk_tokens=chunk, speculate_adaptive=False, speculate_max_batch=8, **LIMITS
    )  # type: ignore[arg-type]
    model, cfg, _ = load_model(folder, dtype=torch.float32, device=CPU)
    store = AdapterStore(cfg, device=CPU, dtype=torch.float32, device_budget_bytes=1 << 24, host_budget_bytes=1 << 24)
    catalog = AdapterCatalog(
        [MedusaPart(medusa := MedusaRegistry(cfg, device=CPU, dtype=torch.float32)), LoraPart(store)]
    )
    for name in ("lora", "both"):
        catalog.register(name, root / name)
        store.ensure(name, timeout=30)
    deadline = time.monotonic() + 30
    while not medusa.request("both"):  # the heads load on the registry's thread
        assert medusa.failure("both") is None and time.monotonic() < deadline
        time.sleep(0.01)
    return Engine(model, Tokenizer.from_folder(folder), settings, adapters=catalog)


@pytest.fixture(scope="module")
def engines(served_tiny_dir: Path, adapter_root: Path) -> Iterator[tuple[Engine, Engine]]:
    on, off = adapter_engine(served_tiny_dir, adapter_root, CHUNK), adapter_engine(served_tiny_dir, adapter_root, 0)
    yield on, off
    for engine in (on, off):
        engine.stop()
        assert engine.adapters is not None
        engine.adapters.close()


def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_running_rows_decode(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    events = Events()
    events.submit(on, req("running", prompt(1, 6), n=40))
    on.step()
    assert len(events.tokens("running")) == 2  # prefill + one decode step
    chunks = counter(metrics.PREFILL_CHUNKS)
    events.submit(on, req("long", prompt(2, 100), n=8))
    lengths = []
    while not events.tokens("long"):
        before = len(events.tokens("running"))
        on.step()
        assert len(events.tokens("running")) == before + 1, "the running row decodes at every step"
        lengths.append(on.scheduler.running[1].length)
    # One chunk per step; the last samples the first token, and the row decodes at that step already.
    assert lengths == [16, 32, 48, 64, 80, 96, 101] and len(events.tokens("long")) == 2
    assert counter(metrics.PREFILL_CHUNKS) - chunks == 7
    step_until(on, events.finished)
    assert idle(on)
    for rid, p, n in (("running", prompt(1, 6), 40), ("long", prompt(2, 100), 8)):
        assert events.tokens(rid) == tokens_of(generate(off, req(f"ref-{rid}", p, n=n))), rid


@pytest.mark.parametrize("adapter", [None, "lora", "both"])
def test_greedy_output_is_the_same_with_and_without_chunking(
    engines: tuple[Engine, Engine], adapter: str | None
) -> None:
    on, off = engines
    lengths = (3, 17, 40, 100, 130)  # up to 9 chunks; several rows of one pass, one stopping short
    requests = [req(f"{adapter}-{n}", prompt(10 + n, n), n=24, adapter_id=adapter) for n in lengths]
    got, want = run(on, *requests), run(off, *requests)
    for r in requests:
        assert got[r.request_id][-1].finish is FinishReason.LENGTH
        assert tokens_of(got[r.request_id]) == tokens_of(want[r.request_id]), r.request_id
    assert idle(on) and idle(off)


@pytest.mark.parametrize("adapter", [None, "lora"])
def test_a_prefix_cache_hit_that_ends_inside_a_chunk(engines: tuple[Engine, Engine], adapter: str | None) -> None:
    on, off = engines
    system = prompt(30, 40)  # 5 blocks of 8: a hit of 40 tokens, not a multiple of the 16-token chunk
    for engine in (on, off):
        generate(engine, req(f"warm-{engine.settings.prefill_chunk_tokens}", [*system, 5], n=2, adapter_id=adapter))
    long = [*system, *prompt(31, 60)]
    hits, chunks = counter(metrics.PREFIX_CACHE_HIT_TOKENS), counter(metrics.PREFILL_CHUNKS)
    got = tokens_of(generate(on, req("hit-on", long, n=24, adapter_id=adapter)))
    assert counter(metrics.PREFIX_CACHE_HIT_TOKENS) - hits == 40
    assert counter(metrics.PREFILL_CHUNKS) - chunks == 4  # 60 tokens from position 40: 16 + 16 + 16 + 12
    assert got == tokens_of(generate(off, req("hit-off", long, n=24, adapter_id=adapter)))


def test_a_row_cancelled_mid_prefill_frees_its_slot(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    events = Events()
    handle = events.submit(on, req("cancelled", prompt(40, 200), n=8))
    on.step()
    on.step()
    (row,) = on.scheduler.running
    assert row.prefilling and row.length == 2 * CHUNK
    handle.cancel()
    on.step()
    assert events.by_id["cancelled"][-1].finish is FinishReason.CANCELLED
    assert not events.tokens("cancelled") and not on.scheduler.running and idle(on)
    after = generate(on, req("next", prompt(41, 30), n=8))  # the freed slot serves the next request
    assert after[-1].finish is FinishReason.LENGTH


class FailingPass:
    """Wraps the model's forward: the ``fail_at``-th prefill pass (``decode=False``: more than one token per row)
    or decode step (``decode=True``: one token per row) fills the K/V it could have written with NaN and raises,
    as a pass that went wrong half-way."""

    def __init__(self, model: Any, fail_at: int, *, decode: bool) -> None:
        self.original, self.fail_at, self.decode, self.passes = model.forward, fail_at, decode, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.original(*args, **kwargs)
        tokens, positions, cache, slot_start = args[:4]
        if (tokens.shape[1] == 1) == self.decode:
            self.passes += 1
            if self.passes == self.fail_at:
                rows = slice(slot_start, slot_start + tokens.shape[0])
                cache.data[:, :, rows, :, : int(positions.max()) + 1] = float("nan")  # [L, 2, B, n_kv, T, D]
                raise RuntimeError("injected fault")
        return out


@pytest.mark.parametrize("decode", [False, True], ids=["failing-chunk", "failing-decode"])
def test_a_failing_pass_fails_its_rows_only(served_tiny_dir: Path, decode: bool) -> None:
    """A running row and a long prompt mid-prefill: the failing pass (the long prompt's third chunk, or the decode
    step beside it) fails its row; the other row goes on and gets the tokens it gets alone."""
    # No prefix cache: the second run of the long prompt must prefill it again, chunk by chunk.
    engine = stepped_engine(served_tiny_dir, prefill_chunk_tokens=CHUNK, prefix_cache_bytes=0, **LIMITS)
    running, long = req("running", prompt(50, 7), n=30), req("long", prompt(51, 90), n=8)
    want = {r.request_id: tokens_of(generate(engine, r)) for r in (running, long)}
    victim, survivor = (running, long) if decode else (long, running)
    failures = counter(metrics.ENGINE_STEP_FAILURES)
    events = Events()
    events.submit(engine, running)
    engine.step()
    fault = FailingPass(engine.model, fail_at=3, decode=decode)
    engine.model.forward = fault  # type: ignore[method-assign]
    try:
        events.submit(engine, long)
        step_until(engine, events.finished)
    finally:
        engine.model.forward = fault.original  # type: ignore[method-assign]
    last = events.by_id[victim.request_id][-1]
    assert last.finish is FinishReason.ERROR and isinstance(last.error, EngineStepFailed)
    assert events.tokens(survivor.request_id) == want[survivor.request_id], "the other row went on, unchanged"
    assert counter(metrics.ENGINE_STEP_FAILURES) == failures + 1 and idle(engine)
    # The NaN the failed pass left in its slot did not survive: the same request now gets its tokens.
    assert tokens_of(generate(engine, victim)) == want[victim.request_id]
    engine.stop()


@pytest.mark.slow
def test_smollm2_greedy_output_is_the_same_with_and_without_chunking(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer.from_folder(smollm2_dir)
    text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box with {i * 7} marbles." for i in range(40))
    long = tokenizer.encode(f"{text}\nQuestion: which colour is item 17, and how many marbles does it hold?")
    assert len(long) > 5 * 64
    short = tokenizer.encode("The three primary colors are")
    settings = {"max_batch_size": 4, "max_total_tokens": 1024, "max_prompt_tokens": 900}
    results = []
    for chunk in (64, 0):
        engine = stepped_engine(smollm2_dir, prefill_chunk_tokens=chunk, **settings)
        events = Events()
        events.submit(engine, req("short", short, n=24))
        engine.step()
        events.submit(engine, req("long", long, n=24))
        step_until(engine, events.finished)
        results.append((events.tokens("short"), events.tokens("long")))
        engine.stop()
    assert results[0] == results[1]


def test_the_chunk_size_comes_from_the_flag_or_the_environment_and_is_checked() -> None:
    assert Settings().prefill_chunk_tokens == 256
    args = build_parser().parse_args(["serve", "--prefill-chunk-tokens", "64"])
    assert serve_settings(args, {}).prefill_chunk_tokens == 64
    assert (
        serve_settings(
            build_parser().parse_args(["serve"]), {"LORAPLEX_PREFILL_CHUNK_TOKENS": "0"}
        ).prefill_chunk_tokens
        == 0
    )
    with pytest.raises(ConfigError, match="prefill_chunk_tokens"):
        serve_settings(build_parser().parse_args(["serve", "--prefill-chunk-tokens", "-1"]), {})
