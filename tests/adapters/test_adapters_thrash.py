"""No device-tier thrash: a load takes the pins of the requests waiting for it as it completes, so a working set
larger than the device budget makes loads wait for room (FIFO) instead of evicting each other's fresh adapters.
The store is walked step by step (state asserted after each); then the engine serves such a working set."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.engines import run_together
from support.stores import three_adapters_served
from support.wait import wait_until

from service import metrics
from service.adapters.catalog import AdapterCatalog
from service.adapters.lora import reader as reader_mod
from service.adapters.lora.part import LoraPart
from service.adapters.lora.registry import index_adapter, plan_nbytes
from service.adapters.lora.store import DEVICE_ALIGN, AdapterStore, StoreState
from service.adapters.medusa.part import MedusaPart
from service.adapters.medusa.registry import MedusaRegistry
from service.config import Settings
from service.engine.engine import Engine
from service.engine.request import FinishReason, GenerationRequest
from service.model.config import ModelConfig
from service.tokenizer import Tokenizer

CPU = torch.device("cpu")


def _unused() -> float:
    return metrics.ADAPTER_EVICTIONS_UNUSED.labels(tier="device")._value.get()


@pytest.fixture(scope="module")
def folders(tiny_peft_adapters: Callable[..., dict[str, Path]]) -> dict[str, Path]:
    return tiny_peft_adapters(
        **{n: {"r": 4, "target_modules": ("q_proj", "v_proj"), "seed": i} for i, n in enumerate("abcd")}
    )


@pytest.fixture()
def store(tiny_cfg: ModelConfig, folders: dict[str, Path], make_store: Callable[..., AdapterStore]) -> AdapterStore:
    one = plan_nbytes(index_adapter("a", folders["a"], tiny_cfg), torch.float32, DEVICE_ALIGN)
    s = make_store(device_budget=2 * one, host_budget=0)
    for name, folder in folders.items():
        s.register(name, folder)
    return s


def _tiers(st: StoreState) -> dict[str, tuple[str, int]]:
    return {k: (v.state, v.pins) for k, v in st.adapters.items()}


def test_fresh_loads_are_pinned_for_their_waiters_and_loads_queue_for_room(store: AdapterStore) -> None:
    wa, wb, wc, wd = (object() for _ in range(4))
    unused = _unused()
    assert store.request("a", pin=True, waiter=wa) is False
    assert store.request("b", pin=True, waiter=wb) is False
    assert store.request("c", pin=True, waiter=wc) is False  # three waiters, room for two
    assert wait_until(lambda: store.get("b").state == "device", 30), "a and b to load"
    time.sleep(0.05)  # the loader had every chance to evict a fresh adapter for c: it must wait instead
    st = store.state()
    assert _tiers(st) == {"a": ("device", 1), "b": ("device", 1), "c": ("loading", 0), "d": ("registered", 0)}
    assert st.device_lru == ("a", "b") and st.queued == ("c",) and _unused() == unused

    assert store.request("a", pin=True, waiter=wa) is True  # a claims the pin its load took for it: still one
    assert store.get("a").pins == 1 and store.get("a").hits == 1
    store.unpin("a")  # a's request retires: room for c, and c's load takes wc's pin
    assert wait_until(lambda: store.get("c").state == "device", 30), "c to load"
    st = store.state()
    assert _tiers(st) == {"a": ("registered", 0), "b": ("device", 1), "c": ("device", 1), "d": ("registered", 0)}
    assert st.queued == () and _unused() == unused  # a had been used: not a wasted load

    store.forget("b", wb)  # b's request gave up waiting (deadline) before claiming it: the pin goes with it
    assert store.get("b").pins == 0
    assert store.request("c", pin=True, waiter=wc) is True and store.get("c").pins == 1
    assert store.request("d", pin=True, waiter=wd) is False
    assert wait_until(lambda: store.get("d").state == "device", 30), "d to load"
    st = store.state()
    assert _tiers(st) == {"a": ("registered", 0), "b": ("registered", 0), "c": ("device", 1), "d": ("device", 1)}
    assert _unused() == unused + 1  # b was loaded and evicted without ever serving a request: counted
    store.forget("d", wd)
    store.forget("d", wd)  # quiet when repeated, and for unknown ids
    store.forget("nope", wd)
    assert store.get("d").pins == 0

    # A request that gives up (its deadline) while its load waits for room takes the queued load with it.
    store.pin("d")
    assert store.request("a", pin=True, waiter=wa) is False
    time.sleep(0.05)
    assert store.state().queued == ("a",) and store.get("a").state == "loading"  # c and d are pinned
    store.forget("a", wa)
    st = store.state()
    assert st.queued == () and _tiers(st)["a"] == ("registered", 0) and st.device_lru == ("c", "d")


# --- the engine --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return three_adapters_served(served_tiny_dir, tmp_path_factory.mktemp("thrash_served"), seed=10)


def _engine(served: dict[str, Any], budget_adapters: int) -> tuple[Engine, AdapterStore]:
    cfg = served["cfg"]
    one = plan_nbytes(index_adapter("x", served["root"] / "x", cfg), torch.float32, DEVICE_ALIGN)
    store = AdapterStore(
        cfg, device=CPU, dtype=torch.float32, device_budget_bytes=budget_adapters * one, host_budget_bytes=0
    )
    catalog = AdapterCatalog([MedusaPart(MedusaRegistry(cfg, device=CPU, dtype=torch.float32)), LoraPart(store)])
    for n in served["names"]:
        catalog.register(n, served["root"] / n)
    settings = Settings(
        model=served["dir"], dtype="float32", max_batch_size=8, max_total_tokens=128, max_prompt_tokens=64
    )
    engine = Engine(served["model"], Tokenizer.from_folder(served["dir"]), settings, adapters=catalog)
    engine.start()
    return engine, store


def _req(rid: str, adapter: str, n: int = 40) -> GenerationRequest:
    prompt = tuple(5 + (hash(rid) % 1000 + i * 37) % 40000 for i in range(8))
    return GenerationRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=n, adapter_id=adapter, ignore_eos=True)


def test_a_working_set_over_the_device_budget_is_served_without_thrash(
    served: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    big, _ = _engine(served, budget_adapters=3)  # the reference: everything fits
    requests = [_req(f"{n}{i}", n) for i in range(3) for n in served["names"]]
    try:
        want = {r.request_id: [t for e in big.generate(r, timeout=60) for t in e.token_ids] for r in requests}
    finally:
        big.stop()

    real = reader_mod.load_tensors

    def slow(*args: Any, **kwargs: Any) -> Any:  # a disk read that takes a while, as real adapters' do
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(reader_mod, "load_tensors", slow)
    engine, store = _engine(served, budget_adapters=2)  # three adapters wanted at once, room for two
    unused = _unused()
    try:
        results = run_together(engine, requests)
        for rid, events in results.items():
            assert events[-1].finish is FinishReason.LENGTH, (rid, events[-1])
        got = {rid: [t for e in events for t in e.token_ids] for rid, events in results.items()}
        assert got == want
        assert _unused() == unused, "an adapter was evicted before the request that waited for it used it"
        # Each adapter loaded once: the third waited for room (an unpin) instead of evicting a fresh one.
        assert {n: store.get(n).loads for n in served["names"]} == dict.fromkeys(served["names"], 1)
    finally:
        engine.stop()
        store.close()


def test_a_request_waiting_for_room_is_bounded_by_its_deadline(served: dict[str, Any]) -> None:
    engine, store = _engine(served, budget_adapters=1)
    try:
        store.ensure("x", timeout=30)
        store.pin("x")  # held (as by a long running request): no room for y
        waiting = GenerationRequest(
            "y-late", (5, 6, 7), 4, adapter_id="y", ignore_eos=True, deadline=time.monotonic() + 0.3
        )
        events = engine.generate(waiting, timeout=60)
        assert events[-1].finish is FinishReason.DEADLINE and not any(e.token_ids for e in events)
        assert wait_until(lambda: store.state().queued == (), 30), "the abandoned load to leave the queue"
        st = store.state()
        assert st.adapters["y"].state == "registered" and st.adapters["y"].pins == 0 and st.device_lru == ("x",)
        store.unpin("x")
        events = engine.generate(_req("y-now", "y", n=4), timeout=60)  # room now: y loads, x is evicted
        assert events[-1].finish is FinishReason.LENGTH and store.state().device_lru == ("y",)
    finally:
        engine.stop()
        store.close()
