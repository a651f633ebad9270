"""Overflow copies: while every adapter on the device tier is held, a load is laid out past the device budget (at
most ``overflow_adapters`` at a time, its bytes charged to the host budget) instead of waiting for an unpin, and it
is dropped the moment nothing holds it. The store is walked step by step (state asserted after each); then the
engine serves a working set over the device budget with one overflow copy."""

from __future__ import annotations

import threading
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
from service.adapters.lora.reader import HOST_ALIGN
from service.adapters.lora.registry import index_adapter, plan_nbytes
from service.adapters.lora.store import DEVICE_ALIGN, AdapterStore
from service.adapters.medusa.part import MedusaPart
from service.adapters.medusa.registry import MedusaRegistry
from service.config import Settings
from service.engine.engine import Engine
from service.engine.request import FinishReason, GenerationRequest
from service.model.config import ModelConfig
from service.tokenizer import Tokenizer

CPU = torch.device("cpu")


def _loads() -> float:
    return metrics.ADAPTER_OVERFLOW_LOADS._value.get()


@pytest.fixture(scope="module")
def folders(tiny_peft_adapters: Callable[..., dict[str, Path]]) -> dict[str, Path]:
    return tiny_peft_adapters(
        **{n: {"r": 4, "target_modules": ("q_proj", "v_proj"), "seed": i} for i, n in enumerate("abcd")}
    )


@pytest.fixture()
def sizes(tiny_cfg: ModelConfig, folders: dict[str, Path]) -> tuple[int, int]:
    spec = index_adapter("a", folders["a"], tiny_cfg)
    return plan_nbytes(spec, torch.float32, DEVICE_ALIGN), plan_nbytes(spec, None, HOST_ALIGN)


def _store(make_store: Callable[..., AdapterStore], folders: dict[str, Path], **kw: Any) -> AdapterStore:
    store = make_store(**kw)
    for name, folder in folders.items():
        store.register(name, folder)
    return store


def _states(store: AdapterStore) -> dict[str, tuple[str, int]]:
    return {k: (v.state, v.pins) for k, v in store.state().adapters.items()}


def test_a_load_with_every_slot_held_overflows_and_the_copy_goes_with_its_last_pin(
    make_store: Callable[..., AdapterStore], folders: dict[str, Path], sizes: tuple[int, int]
) -> None:
    one, raw = sizes
    store = _store(make_store, folders, device_budget=2 * one, host_budget=4 * raw + one, overflow=1)
    wa, wb, wc, wd = (object() for _ in range(4))
    before = _loads()
    for name, waiter in (("a", wa), ("b", wb)):
        assert store.request(name, pin=True, waiter=waiter) is False
        assert wait_until(lambda n=name: store.get(n).state == "device", 30), f"{name} to load"
        assert store.request(name, pin=True, waiter=waiter) is True  # claimed: held by a running row
    assert store.overflow() == ((), 0) and _loads() == before

    assert store.request("c", pin=True, waiter=wc) is False  # a and b are held: c overflows instead of waiting
    assert wait_until(lambda: store.get("c").state == "device", 30), "c to load as an overflow copy"
    st = store.state()
    assert store.overflow() == (("c",), one) and _loads() == before + 1
    assert st.device_bytes == 2 * one and st.device_lru == ("a", "b")  # the device budget holds
    assert st.host_bytes + one <= st.host_budget_bytes  # the host budget holds raw and overflow bytes together
    assert metrics.ADAPTER_OVERFLOW_BYTES._value.get() == one

    assert store.request("d", pin=True, waiter=wd) is False  # the one overflow copy is taken: d waits
    time.sleep(0.05)
    assert store.state().queued == ("d",) and store.get("d").state == "loading"

    assert store.request("c", pin=True, waiter=wc) is True
    store.unpin("c")  # c's row retires: its copy goes (its host copy stays), and d takes the overflow room
    assert wait_until(lambda: store.get("d").state == "device", 30), "d to load as an overflow copy"
    assert _states(store) == {"a": ("device", 1), "b": ("device", 1), "c": ("host", 0), "d": ("device", 1)}
    assert store.overflow() == (("d",), one) and _loads() == before + 2

    store.forget("d", wd)  # d's request gave up before claiming it: the promised pin and the copy go with it
    assert store.overflow() == ((), 0) and store.get("d").state == "host"
    store.unpin("a")  # a stays cached on the device tier (within the budget), unheld
    assert store.request("c", pin=True, waiter=wc) is False
    assert wait_until(lambda: store.get("c").state == "device", 30), "c to load into a's room"
    st = store.state()
    assert store.overflow() == ((), 0) and st.device_lru == ("b", "c") and _loads() == before + 2


def test_overflow_is_charged_to_the_host_budget_and_off_at_zero(
    make_store: Callable[..., AdapterStore], folders: dict[str, Path], sizes: tuple[int, int]
) -> None:
    one, _ = sizes
    for kw in ({"host_budget": 0, "overflow": 4}, {"host_budget": 1 << 20, "overflow": 0}):
        store = _store(make_store, folders, device_budget=one, **kw)
        store.ensure("a", timeout=30)
        store.pin("a")
        before = _loads()
        assert store.request("b", pin=True, waiter=object()) is False
        time.sleep(0.05)  # the loader had every chance to overflow: no host room, or no overflow allowed
        assert store.state().queued == ("b",) and store.overflow() == ((), 0) and _loads() == before, kw
        store.unpin("a")  # room: b loads in a's place
        assert wait_until(lambda s=store: s.get("b").state == "device", 30), kw
        assert store.state().device_lru == ("b",) and store.overflow() == ((), 0)


def test_a_negative_overflow_is_refused(tiny_cfg: ModelConfig) -> None:
    with pytest.raises(ValueError, match="overflow_adapters must be >= 0"):
        AdapterStore(tiny_cfg, device=CPU, dtype=torch.float32, device_budget_bytes=1, host_budget_bytes=1,
                     overflow_adapters=-1)  # fmt: skip


# --- the engine --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return three_adapters_served(served_tiny_dir, tmp_path_factory.mktemp("overflow_served"), seed=20)


def _engine(served: dict[str, Any], budget_adapters: int, overflow: int) -> tuple[Engine, AdapterStore]:
    cfg = served["cfg"]
    one = plan_nbytes(index_adapter("x", served["root"] / "x", cfg), torch.float32, DEVICE_ALIGN)
    store = AdapterStore(
        cfg, device=CPU, dtype=torch.float32, device_budget_bytes=budget_adapters * one,
        host_budget_bytes=4 * one, overflow_adapters=overflow,
    )  # fmt: skip
    catalog = AdapterCatalog([MedusaPart(MedusaRegistry(cfg, device=CPU, dtype=torch.float32)), LoraPart(store)])
    for n in served["names"]:
        catalog.register(n, served["root"] / n)
    settings = Settings(
        model=served["dir"], dtype="float32", max_batch_size=8, max_total_tokens=128, max_prompt_tokens=64
    )
    engine = Engine(served["model"], Tokenizer.from_folder(served["dir"]), settings, adapters=catalog)
    engine.start()
    return engine, store


def _req(rid: str, adapter: str) -> GenerationRequest:
    prompt = tuple(5 + (hash(rid) % 1000 + i * 37) % 40000 for i in range(8))
    return GenerationRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=40, adapter_id=adapter, ignore_eos=True)


def test_rows_on_an_overflow_copy_match_the_all_resident_tokens(
    served: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = [_req(f"{n}{i}", n) for i in range(2) for n in served["names"]]
    big, big_store = _engine(served, budget_adapters=3, overflow=0)  # the reference: everything fits
    try:
        want = {r.request_id: [t for e in big.generate(r, timeout=60) for t in e.token_ids] for r in requests}
    finally:
        big.stop()
        big_store.close()

    real, logits, third = reader_mod.load_tensors, served["model"].logits, served["names"][-1]
    loading, third_loading = threading.Event(), threading.Event()

    def slow(records: dict[str, Any], *args: Any, **kwargs: Any) -> Any:  # the first rows still run meanwhile
        loading.set()
        if any(r.file.parent.name == third for r in records.values()):
            third_loading.set()
        time.sleep(0.05)
        return real(records, *args, **kwargs)

    def held(*args: Any, **kwargs: Any) -> Any:  # no adapter row retires (unpins) before the third load is laid out
        if loading.is_set() and not third_loading.wait(10):  # (the gate request of run_together runs before loads)
            third_loading.set()  # waited in vain: once, not on every step
        return logits(*args, **kwargs)

    monkeypatch.setattr(reader_mod, "load_tensors", slow)
    monkeypatch.setattr(served["model"], "logits", held)
    engine, store = _engine(served, budget_adapters=2, overflow=1)  # three adapters wanted at once, room for two
    before = _loads()
    try:
        results = run_together(engine, requests)
        got = {rid: [t for e in events for t in e.token_ids] for rid, events in results.items()}
        assert all(events[-1].finish is FinishReason.LENGTH for events in results.values())
        assert got == want
        assert _loads() > before, "no load overflowed: the third adapter waited for an unpin"
        st = store.state()
        assert store.overflow() == ((), 0) and st.device_bytes <= st.device_budget_bytes  # gone with its rows
        assert all(a.pins == 0 for a in st.adapters.values())
    finally:
        engine.stop()
        store.close()
