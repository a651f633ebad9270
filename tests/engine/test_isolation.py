"""A broken adapter fails itself, never its neighbours: row isolation in the LoRA math and the KV cache is
structural, and a row whose logits become non-finite ends alone with an error naming its adapter.

The math is checked with NaN weights handed straight to ``AdapterBatch`` (both layouts, eager and on the compiled
kernel); the engine with a real adapter file whose weights are finite (so they pass the store's checks) but
overflow to inf at run time."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapter_files import rewrite_adapter_tensors, write_peft_adapter
from support.engines import run_together
from support.native import compiled_kernels

from service.adapters.catalog import AdapterCatalog
from service.adapters.lora.batch import AdapterBatch, LoraTables
from service.adapters.lora.part import LoraPart
from service.adapters.lora.store import AdapterStore
from service.adapters.lora.types import LoraLayer, LoraModule
from service.adapters.medusa.part import MedusaPart
from service.adapters.medusa.registry import MedusaRegistry
from service.config import Settings
from service.engine.engine import Engine
from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.engine.sampling import SamplingParams
from service.errors import FailedPrecondition
from service.model.kv_cache import KV_LIMIT, KVCache, finite_kv
from service.model.load_folder import load_model
from service.tokenizer import Tokenizer

pytestmark = pytest.mark.numerics

CPU = torch.device("cpu")


# --- the LoRA math -------------------------------------------------------------------------------------------


def _layer(cfg: Any, seed: int, *, fill: float | None = None, where: str = "b") -> LoraLayer:
    g = torch.Generator().manual_seed(seed)
    hidden, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    modules = {}
    for name, out in (("q_proj", cfg.num_heads * cfg.head_dim), ("v_proj", kv)):
        a, b = torch.randn(4, hidden, generator=g) / hidden**0.5, torch.randn(out, 4, generator=g) * 0.1
        if fill is not None:
            (b if where == "b" else a).fill_(fill)
        modules[name] = LoraModule(a=a, b=b)
    return LoraLayer(modules=modules, nbytes=0)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Any:
    return load_model(tiny_llama_dir, dtype=torch.float32, device=CPU)[0]


@pytest.mark.parametrize("path", ["kernel", "eager"])
@pytest.mark.parametrize("mode", ["shared", "slots"])
@pytest.mark.parametrize(("fill", "where"), [(math.nan, "b"), (math.inf, "b"), (math.nan, "a")])
def test_a_nan_adapter_row_never_reaches_other_rows(tiny: Any, mode: str, fill: float, where: str, path: str) -> None:
    kern = compiled_kernels() if path == "kernel" else None  # the batched math on the compiled kernel, or eager
    cfg = tiny.cfg
    healthy = {"x": _layer(cfg, 1), "y": _layer(cfg, 2), "z": _layer(cfg, 3)}
    broken = {**healthy, "z": _layer(cfg, 3, fill=fill, where=where)}
    rows: list[str | None] = ["x", None, "z", "x", "y", None, "z", "x"]
    tokens = torch.randint(3, cfg.vocab_size, (len(rows), 5), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5).expand(len(rows), 5)

    def run(layers: dict[str, LoraLayer]) -> torch.Tensor:
        tables = LoraTables(cfg, device=CPU, dtype=torch.float32, native=kern)
        batch = AdapterBatch.build(rows, lambda a, _layer: layers[a], tables, mode=mode)  # type: ignore[arg-type]
        cache = KVCache(cfg, len(rows), 16, dtype=torch.float32, device=CPU)
        return tiny.logits(tiny(tokens, positions, cache, 0, batch))  # [B, T, V]

    want, got = run(healthy), run(broken)
    for b, adapter in enumerate(rows):
        if adapter == "z":
            assert not torch.isfinite(got[b]).all(), "the broken rows are broken"
        else:
            assert torch.equal(got[b], want[b]), f"row {b} ({adapter}) changed because of adapter z"


def test_kv_written_is_finite_and_the_identity_on_healthy_values() -> None:
    x = torch.tensor([1.5, -2.0, math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0])
    assert finite_kv(x).tolist() == [1.5, -2.0, 0.0, KV_LIMIT, -KV_LIMIT, KV_LIMIT, -KV_LIMIT, 0.0]
    healthy = torch.randn(64, 8) * 100
    assert torch.equal(finite_kv(healthy), healthy)


def test_a_poisoned_slot_does_not_change_its_next_occupant(tiny: Any) -> None:
    """Slot 0 first holds a row with NaN K/V (a NaN adapter on v_proj); then a short base row takes slot 0 next
    to a longer row in slot 1, so it attends (masked) over the positions the broken row left behind."""
    cfg = tiny.cfg
    nan = {"z": _layer(cfg, 3, fill=math.nan)}
    cache = KVCache(cfg, 2, 32, dtype=torch.float32, device=CPU)
    g = torch.Generator().manual_seed(1)
    poison = torch.randint(3, cfg.vocab_size, (1, 20), generator=g)
    tables = LoraTables(cfg, device=CPU, dtype=torch.float32, native=tiny.lora_native)
    batch = AdapterBatch.build(["z"], lambda a, _l: nan[a], tables)
    assert not torch.isfinite(tiny(poison, torch.arange(20)[None], cache, 0, batch)).all()
    assert torch.isfinite(cache.data).all(), "the cache keeps no NaN/inf, whatever a row computed"

    short = torch.randint(3, cfg.vocab_size, (1, 3), generator=g)
    long = torch.randint(3, cfg.vocab_size, (1, 12), generator=g)

    def run(c: KVCache) -> torch.Tensor:
        tiny(short, torch.arange(3)[None], c, 0)  # slot 0: positions 0..2; 3..19 keep what was there
        tiny(long, torch.arange(12)[None], c, 1)
        step = torch.tensor([[3], [12]])  # one decode step of both: the short row attends, masked, up to 12
        return tiny(torch.tensor([[5], [6]]), step, c, 0, kv_len=13)[0]

    clean = KVCache(cfg, 2, 32, dtype=torch.float32, device=CPU)
    assert torch.equal(run(cache), run(clean)), "the short row's output depends on its slot's former occupant"


# --- the engine ----------------------------------------------------------------------------------------------

PROMPTS = {"base-a": [5, 17, 300, 4000, 42, 9], "good": [7, 7, 7, 100, 200], "base-b": [1000, 2000, 3000]}
BOOM_PROMPT = [11 + i for i in range(30)]
LONG_PROMPT = [300 + i for i in range(60)]


@pytest.fixture(scope="module")
def engine(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("isolation")
    write_peft_adapter(root / "good", served_tiny_dir, r=4, target_modules=("q_proj", "v_proj"), seed=1, scale=0.5)
    boom = write_peft_adapter(root / "boom", served_tiny_dir, r=8, alpha=8, target_modules=("q_proj",), seed=2)
    # Finite weights (they pass every check when read) whose products overflow fp32 at run time.
    rewrite_adapter_tensors(boom, lambda t: {k: v.fill_(1e38) if "lora_B" in k else v for k, v in t.items()})
    write_peft_adapter(root / "calm", served_tiny_dir, r=8, alpha=8, target_modules=("q_proj",), seed=2)
    settings = Settings(
        model=served_tiny_dir, dtype="float32", max_batch_size=8, max_total_tokens=256, max_prompt_tokens=128
    )
    model, cfg, _ = load_model(served_tiny_dir, dtype=torch.float32, device=CPU)
    store = AdapterStore(cfg, device=CPU, dtype=torch.float32, device_budget_bytes=1 << 24, host_budget_bytes=1 << 24)
    catalog = AdapterCatalog([MedusaPart(MedusaRegistry(cfg, device=CPU, dtype=torch.float32)), LoraPart(store)])
    for name in ("good", "boom", "calm"):
        catalog.register(name, root / name)
        store.ensure(name, timeout=30)
    eng = Engine(model, Tokenizer.from_folder(served_tiny_dir), settings, adapters=catalog)
    eng.start()
    yield eng
    eng.stop()
    catalog.close()


def _req(rid: str, prompt: list[int], adapter: str | None, n: int = 12) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        prompt_ids=tuple(prompt),
        max_new_tokens=n,
        adapter_id=adapter,
        ignore_eos=True,
        sampling=SamplingParams(logprobs=True),
    )


def _trace(events: list[TokenEvent]) -> tuple[list[int], list[float]]:
    return [t for e in events for t in e.token_ids], [p for e in events for p in (e.logprobs or ())]


def test_a_row_that_overflows_fails_alone_and_its_neighbours_are_bit_identical(engine: Engine) -> None:
    adapters = {"base-a": None, "good": "good", "base-b": None}
    alone = {rid: _trace(engine.generate(_req(rid, p, adapters[rid]), timeout=60)) for rid, p in PROMPTS.items()}
    others = [_req(rid, p, adapters[rid]) for rid, p in PROMPTS.items()]

    # The reference: the same batches with a healthy twin of the broken adapter in its place, ending at the same
    # step (one token), so every step has the same rows, slots and adapter mix (fp32 results depend on those).
    twin = run_together(engine, [_req("boom", BOOM_PROMPT, "calm", n=1), *others])
    assert twin["boom"][-1].finish is FinishReason.LENGTH
    got = run_together(engine, [_req("boom", BOOM_PROMPT, "boom"), *others])
    last = got["boom"][-1]
    assert last.finish is FinishReason.ERROR and isinstance(last.error, FailedPrecondition)
    assert last.error.status == "FAILED_PRECONDITION"
    assert "'boom'" in str(last.error) and "non-finite" in str(last.error)
    assert not any(e.token_ids for e in got["boom"]), "no token is sampled from NaN logits"
    for rid in PROMPTS:
        assert _trace(got[rid]) == _trace(twin[rid]), f"{rid} changed next to the failing row"
        assert _trace(got[rid])[0] == alone[rid][0], f"{rid}: not the tokens it gets alone"

    # The failing row's slot is reused: the overflowing row alone in slot 0, then a short row takes slot 0 next to
    # a longer one, reading (masked) past its length where the failed row's K/V stay. Reference: the same pair
    # after a healthy twin used slot 0.
    def after(adapter: str) -> dict[str, list[TokenEvent]]:
        first = engine.generate(_req(f"{adapter}-first", BOOM_PROMPT, adapter, n=1), timeout=60)
        assert first[-1].finish is (FinishReason.ERROR if adapter == "boom" else FinishReason.LENGTH)
        wait_until_idle(engine)
        return run_together(engine, [_req("short", PROMPTS["base-b"], None), _req("long", LONG_PROMPT, None)])

    # Both runs find the long prompt in the prefix cache (the first run would otherwise leave it for the second), so
    # they run passes of the same shapes: float32 results depend on those.
    run_together(engine, [_req("warm", LONG_PROMPT, None, n=1)])
    reused, fresh = after("boom"), after("calm")
    assert _trace(reused["short"]) == _trace(fresh["short"]), "the next occupant of the failed row's slot changed"
    assert _trace(reused["long"]) == _trace(fresh["long"])
    assert reused["short"][-1].finish is FinishReason.LENGTH


def wait_until_idle(engine: Engine, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while engine.in_flight and time.monotonic() < end:
        time.sleep(0.01)
