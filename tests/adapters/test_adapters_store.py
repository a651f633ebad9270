"""AdapterStore: registration reads headers only (fast, compact), loads are lazy, single-flight and off the
caller's thread, tiers respect their budgets with LRU eviction and pins, a host copy saves a disk read, and the
laid-out weights are peft's lora_A and scaled lora_B. State is asserted after every step of each sequence."""

from __future__ import annotations

import contextlib
import json
import os
import random
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapter_files import load_peft_model, rewrite_adapter_tensors
from support.stores import new_store

from service import metrics
from service.adapters.lora import reader as reader_mod
from service.adapters.lora.peft import module_key
from service.adapters.lora.store import AdapterStore, StoreState
from service.errors import (
    AdapterNotFound,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    HeaderError,
    InvalidAdapter,
    PermissionDenied,
    ResourceExhausted,
)
from service.model.config import ModelConfig

CPU = torch.device("cpu")
ONE = 7168  # bytes of one adapter below (r=4 on q_proj + v_proj of 2 layers, fp32), on either tier


@pytest.fixture(scope="module")
def base(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir


@pytest.fixture(scope="module")
def adapters(tiny_peft_adapters: Callable[..., dict[str, Path]]) -> dict[str, Path]:
    """Six same-sized adapters (a..f) and some of other shapes, written by peft."""
    return tiny_peft_adapters(
        **{name: {"r": 4, "target_modules": ("q_proj", "v_proj"), "seed": i} for i, name in enumerate("abcdef")},
        mixed={
            "r": 8,
            "alpha": 4,
            "target_modules": ("k_proj", "o_proj", "gate_proj", "down_proj"),
            "rank_pattern": {"down_proj": 2},
            "alpha_pattern": {r"layers\.1\.self_attn\.o_proj": 24},
            "layers_to_transform": [1],
            "seed": 10,
        },
        rslora={"r": 16, "alpha": 8, "rslora": True, "target_modules": "all-linear", "seed": 11},
        bf16={"r": 2, "target_modules": ("up_proj",), "dtype": torch.bfloat16},
    )


def _tiers(st: StoreState) -> dict[str, str]:
    return {k: v.state for k, v in st.adapters.items()}


def _check_budgets(st: StoreState) -> None:
    assert 0 <= st.device_bytes <= st.device_budget_bytes
    assert 0 <= st.host_bytes <= st.host_budget_bytes
    assert st.device_bytes == sum(a.device_bytes for a in st.adapters.values())
    assert st.host_bytes == sum(a.host_bytes for a in st.adapters.values())


def _reference(folder: Path, base: Path, name: str = "x") -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """peft's (lora_A, lora_B * scaling) for every adapted module, fp32."""
    model = load_peft_model(base, {name: folder})
    out = {}
    for full, module in model.named_modules():
        if hasattr(module, "lora_A") and name in getattr(module, "r", {}):
            parts = full.split("base_model.model.", 1)[-1].split(".")
            a = module.lora_A[name].weight.detach().float()
            b = module.lora_B[name].weight.detach().float() * module.scaling[name]
            out[(int(parts[2]), parts[4])] = (a, b)
    return out


def _laid_out(store: AdapterStore, adapter_id: str, cfg: ModelConfig) -> dict[tuple[int, str], tuple[Any, Any]]:
    out = {}
    for layer in range(cfg.num_layers):
        lora = store.layer(adapter_id, layer)
        if lora is not None:
            for m, mod in lora.modules.items():
                out[(layer, m)] = (mod.a, mod.b)
    return out


# --- registration -------------------------------------------------------------------------------------------


def test_register_reads_headers_only(make_store: Callable[..., AdapterStore], adapters: dict[str, Path]) -> None:
    store = make_store()
    info = store.register("mixed", adapters["mixed"])
    assert info.state == "registered" and info.kind == "lora"
    assert (info.rank, info.ranks) == (8, {"k_proj": 8, "o_proj": 8, "gate_proj": 8, "down_proj": 2})
    assert info.target_modules == ("k_proj", "o_proj", "gate_proj", "down_proj") and info.layers == (1,)
    assert (info.host_bytes, info.device_bytes, info.disk_reads, info.disk_bytes, info.loads) == (0, 0, 0, 0, 0)
    assert info.index_seconds > 0 and info.last_used is None and info.pins == 0
    assert store.list() == [info] and store.get("mixed") == info
    with pytest.raises(AlreadyExists):
        store.register("mixed", adapters["a"])
    with pytest.raises(AdapterNotFound):
        store.get("nope")
    with pytest.raises(AdapterNotFound):
        store.request("nope")
    with pytest.raises(AdapterNotFound):
        store.unregister("nope")
    assert store.state().queued == () and store.state().disk_reads == 0


def _write_sparse_adapter(folder: Path, cfg: ModelConfig, r: int, dtype: str = "BF16") -> int:
    """A PEFT adapter for every projection of every layer whose data section is a hole (nothing on disk)."""
    from service.adapters.lora.peft import module_features

    folder.mkdir()
    features = module_features(cfg)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    cursor = 0
    for layer in range(cfg.num_layers):
        for m, (fin, fout) in features.items():
            for ab, shape in (("A", [r, fin]), ("B", [fout, r])):
                n = shape[0] * shape[1] * 2
                name = f"base_model.model.{module_key(layer, m)}.lora_{ab}.weight"
                header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + n]}
                cursor += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + cursor)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(features), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return cursor


LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rope_theta": 500000.0,
}  # fmt: skip
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True,
}  # fmt: skip


def _bytes_read() -> int:
    """Bytes this process has read through read(2) and friends so far (``rchar`` of /proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_registering_a_huge_adapter_reads_only_its_header(tmp_path: Path) -> None:
    """1.7 GB of r=64 LoRA for a 70B-shaped model registers by reading its config and header only: the bytes the
    process reads per registration stay under 2 MiB (the header is ~0.2 MB), whatever the file's size."""
    if not Path("/proc/self/io").is_file():
        pytest.skip("needs /proc")
    cfg = ModelConfig.from_dict(LLAMA_70B)
    nbytes = _write_sparse_adapter(tmp_path / "big", cfg, r=64)
    assert nbytes > 1.5e9
    store = new_store(cfg, device_budget=1 << 30)
    for i in range(3):
        before = _bytes_read()
        info = store.register(f"big{i}", tmp_path / "big")
        read = _bytes_read() - before
        assert info.state == "registered" and info.disk_bytes == 0 and len(info.layers) == 80
        assert read < 2 * 2**20, read
    assert store.request("big0") is False  # laid out in fp32 it needs 3.3 GB: refused by name, nothing read
    assert isinstance(store.failure("big0"), ResourceExhausted)
    with pytest.raises(ResourceExhausted, match="more than the whole adapter device budget"):
        store.ensure("big0")
    assert store.state().disk_bytes == 0 and store.get("big0").state == "failed" and store.state().queued == ()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_thousand_registrations_fit_in_100mb(tmp_path: Path) -> None:
    """1,000 SmolLM2-sized adapters (r=8 on all 7 projections of 30 layers) hold < 100 MB: the Python objects
    one registration keeps (tracemalloc, 20 of them) and the process's resident memory over all 1,000."""
    if not Path("/proc/self/statm").is_file():
        pytest.skip("needs /proc")
    cfg = ModelConfig.from_dict(SMOLLM2)
    _write_sparse_adapter(tmp_path / "s", cfg, r=8)
    store = new_store(cfg)
    store.register("warmup", tmp_path / "s")  # imports, regex caches
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20):
            store.register(f"traced-{i:03d}", tmp_path / "s")
        per_adapter = (tracemalloc.get_traced_memory()[0] - before) / 20
    finally:
        tracemalloc.stop()
    assert per_adapter < 30_000, f"{per_adapter:.0f} bytes per adapter"  # the compact index: ~10 KB each
    rss, before = _rss(), _bytes_read()
    for i in range(1000):
        store.register(f"adapter-{i:04d}", tmp_path / "s")
    grown, read = _rss() - rss, _bytes_read() - before
    assert len(store.list()) == 1021
    assert grown < 100e6, grown
    assert read / 1000 < 256 * 2**10, read  # config + header per registration, never the tensors


# --- loading ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype", "tol"),
    [("a", torch.float32, 0), ("mixed", torch.float32, 0), ("rslora", torch.float32, 0), ("bf16", torch.float32, 0),
     ("rslora", torch.bfloat16, 1e-2), ("mixed", torch.float16, 2e-3)],
)  # fmt: skip
def test_laid_out_weights_are_peft_lora_a_and_scaled_b(
    name: str, dtype: torch.dtype, tol: float, tiny_cfg: ModelConfig, base: Path, adapters: dict[str, Path]
) -> None:
    ref = _reference(adapters[name], base)
    with new_store(tiny_cfg, dtype=dtype) as store:
        store.register(name, adapters[name])
        assert store.request(name) is False
        store.ensure(name, timeout=30)
        got = _laid_out(store, name, tiny_cfg)
        assert set(got) == set(ref)
        for key, (a, b) in got.items():
            assert a.dtype == b.dtype == dtype and a.device == b.device == CPU
            assert a.is_contiguous() and b.is_contiguous()
            torch.testing.assert_close(a.float(), ref[key][0], rtol=tol, atol=tol)
            torch.testing.assert_close(b.float(), ref[key][1], rtol=tol, atol=tol * ref[key][1].abs().max().item())
        info = store.get(name)
        assert info.state == "device" and info.loads == 1 and info.disk_reads == 1
        assert (
            info.disk_bytes
            == info.host_bytes
            == (adapters[name] / "adapter_model.safetensors").stat().st_size - (_header_len(adapters[name]))
        )
        tensors = [lora for layer in range(tiny_cfg.num_layers) if (lora := store.layer(name, layer)) is not None]
        n_tensors = 2 * sum(len(lora.modules) for lora in tensors)
        padding = info.device_bytes - sum(lora.nbytes for lora in tensors)  # buffer size, 256-byte aligned views
        assert 0 <= padding < 256 * n_tensors
        assert info.total_seconds >= info.read_seconds + info.layout_seconds > 0


def _header_len(folder: Path) -> int:
    with open(folder / "adapter_model.safetensors", "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_layer_lookup(make_store: Callable[..., AdapterStore], adapters: dict[str, Path]) -> None:
    store = make_store()
    store.register("mixed", adapters["mixed"])
    with pytest.raises(FailedPrecondition, match="not resident"):
        store.layer("mixed", 1)
    store.ensure("mixed", timeout=30)
    assert store.layer("mixed", 0) is None  # layers_to_transform=[1]
    lora = store.layer("mixed", 1)
    assert lora is not None and set(lora.modules) == {"k_proj", "o_proj", "gate_proj", "down_proj"}
    assert lora.modules["down_proj"].rank == 2 and lora.modules["k_proj"].rank == 8
    assert store.layer("mixed", 1) is lora  # the same object every call: no per-call allocation
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(1000):
            store.layer("mixed", 1)
        assert tracemalloc.get_traced_memory()[0] - before < 1000
    finally:
        tracemalloc.stop()


def test_tiers_lru_pins_and_eviction_sequence(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path]
) -> None:
    """Device tier holds 2 adapters, host tier 3. Walk through loads, evictions, re-promotion and pins."""
    store = make_store(device_budget=2 * ONE, host_budget=3 * ONE)
    for name in "abcd":
        store.register(name, adapters[name])

    def step(device: tuple[str, ...], host: tuple[str, ...], disk_reads: int, states: dict[str, str]) -> StoreState:
        st = store.state()
        _check_budgets(st)
        assert st.device_lru == device and st.host_lru == host and st.disk_reads == disk_reads
        assert _tiers(st) == states
        return st

    store.ensure("a")
    st = step(("a",), ("a",), 1, {"a": "device", "b": "registered", "c": "registered", "d": "registered"})
    assert st.device_bytes == ONE and st.host_bytes == ONE
    store.ensure("b")
    step(("a", "b"), ("a", "b"), 2, {"a": "device", "b": "device", "c": "registered", "d": "registered"})
    assert store.request("a") is True  # a hit makes a the most recent
    assert store.get("a").hits == 2  # ensure() counted one
    step(("b", "a"), ("b", "a"), 2, {"a": "device", "b": "device", "c": "registered", "d": "registered"})
    store.ensure("c")  # the device tier is full: b (LRU) drops to the host tier
    step(("a", "c"), ("b", "a", "c"), 3, {"a": "device", "b": "host", "c": "device", "d": "registered"})
    store.ensure("b")  # back from the host tier: no disk read; a (LRU) drops to host
    step(("c", "b"), ("a", "c", "b"), 3, {"a": "host", "b": "device", "c": "device", "d": "registered"})
    assert store.get("b").disk_reads == 1 and store.get("b").loads == 2 and store.get("b").read_seconds == 0.0
    store.pin("c")  # a pin counts as a use: c becomes the most recent on both tiers
    step(("b", "c"), ("a", "b", "c"), 3, {"a": "host", "b": "device", "c": "device", "d": "registered"})
    store.ensure("d")  # b is evicted (c is pinned); the host tier drops its LRU copy, a's, to disk only
    st = step(("c", "d"), ("b", "c", "d"), 4, {"a": "registered", "b": "host", "c": "device", "d": "device"})
    assert st.adapters["c"].pins == 1
    with pytest.raises(FailedPrecondition, match="in use by 1 running request"):
        store.unregister("c")
    store.ensure("a")  # from disk again; d is the only unpinned resident; b's host copy makes room for a's
    step(("c", "a"), ("c", "d", "a"), 5, {"a": "device", "b": "registered", "c": "device", "d": "host"})
    assert store.get("a").disk_reads == 2
    store.unpin("c")
    step(("a", "c"), ("d", "a", "c"), 5, {"a": "device", "b": "registered", "c": "device", "d": "host"})
    with pytest.raises(FailedPrecondition, match="not pinned"):
        store.unpin("c")
    store.unregister("c")
    st = step(("a",), ("d", "a"), 5, {"a": "device", "b": "registered", "d": "host"})
    assert st.device_bytes == ONE and st.host_bytes == 2 * ONE
    # Evictions from the device tier, per adapter (an unregister is not one): b twice, a once, d once.
    assert {k: v.evictions for k, v in st.adapters.items()} == {"a": 1, "b": 2, "d": 1}


def test_per_adapter_residency_gauge_follows_the_tiers(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path]
) -> None:
    """loraplex_adapter_tier_bytes{adapter, tier} holds each adapter's copies, load by load and eviction by
    eviction, and drops to 0 on unregister."""
    from service import metrics

    metrics.ADAPTERS.reset(8)
    store = make_store(device_budget=ONE, host_budget=ONE)
    for name in "ab":
        store.register(name, adapters[name])

    def shown(adapter: str, tier: str) -> float:
        return metrics.ADAPTER_TIER_BYTES.labels(adapter, tier)._value.get()

    store.ensure("a")
    a = store.get("a")
    assert (shown("a", "device"), shown("a", "host")) == (a.device_bytes, a.host_bytes) and a.host_bytes > 0
    store.ensure("b")  # a leaves the device; its host copy makes room for b's
    assert (shown("a", "device"), shown("a", "host")) == (0, 0)
    b = store.get("b")
    assert (shown("b", "device"), shown("b", "host")) == (b.device_bytes, b.host_bytes)
    store.unregister("b")
    assert (shown("b", "device"), shown("b", "host")) == (0, 0)


def test_prefetch_loads_into_free_room_only(make_store: Callable[..., AdapterStore], adapters: dict[str, Path]) -> None:
    """prefetch starts a load with no pin and no hit; it never evicts, and is quiet about unknown ids."""
    store = make_store(device_budget=2 * ONE, host_budget=3 * ONE)
    for name in "abc":
        store.register(name, adapters[name])
    store.prefetch("a")
    deadline = time.monotonic() + 10
    while store.get("a").state != "device" and time.monotonic() < deadline:
        time.sleep(0.005)
    info = store.get("a")
    assert info.state == "device" and info.pins == 0 and info.hits == 0 and info.loads == 1
    store.prefetch("a")  # resident: nothing to do
    store.prefetch("nope")  # unknown: the request itself reports it
    store.ensure("b")
    store.prefetch("c")  # the device tier is full: no eviction for a request that has not been admitted
    time.sleep(0.05)
    assert _tiers(store.state()) == {"a": "device", "b": "device", "c": "registered"}
    assert store.request("c", pin=True) is False  # admission does evict (a, the least recently used)
    store.ensure("c")
    assert _tiers(store.state()) == {"a": "host", "b": "device", "c": "device"}


def test_no_host_tier_means_rereading_the_disk(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path]
) -> None:
    store = make_store(device_budget=ONE, host_budget=0)
    store.register("a", adapters["a"])
    store.register("b", adapters["b"])
    store.ensure("a")
    assert _tiers(store.state()) == {"a": "device", "b": "registered"} and store.state().host_bytes == 0
    store.ensure("b")
    assert _tiers(store.state()) == {"a": "registered", "b": "device"}
    store.ensure("a")
    assert store.get("a").disk_reads == 2 and store.state().disk_reads == 3


def test_cycling_many_adapters_through_a_tiny_budget(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path], tiny_cfg: ModelConfig, base: Path
) -> None:
    """Six adapters cycle through a 2-adapter device tier and a 4-adapter host tier: budgets hold after every
    step and the weights served are always the right adapter's."""
    store = make_store(device_budget=2 * ONE, host_budget=4 * ONE)
    names = "abcdef"
    refs = {n: _reference(adapters[n], base) for n in names}
    for n in names:
        store.register(n, adapters[n])
    rng = random.Random(0)
    order = [rng.choice(names) for _ in range(24)]
    for n in order:
        store.ensure(n, timeout=30)
        store.pin(n)
        got = _laid_out(store, n, tiny_cfg)
        for key, (a, b) in got.items():
            torch.testing.assert_close(a, refs[n][key][0], rtol=0, atol=0)
            torch.testing.assert_close(b, refs[n][key][1], rtol=0, atol=0)
        store.unpin(n)
        st = store.state()
        _check_budgets(st)
        assert len(st.device_lru) <= 2 and len(st.host_lru) <= 4 and st.device_lru[-1] == n
    assert store.state().disk_reads < len(order)  # some reuses came from the host tier


def test_single_flight(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = reader_mod.load_tensors

    def slow(*args: Any, **kwargs: Any) -> Any:
        calls.append(threading.get_ident())
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(reader_mod, "load_tensors", slow)
    store = make_store()
    store.register("a", adapters["a"])
    barrier = threading.Barrier(4)
    results: list[bool] = []

    def racer() -> None:
        barrier.wait()
        results.append(store.request("a"))
        store.ensure("a", timeout=30)

    threads = [threading.Thread(target=racer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [False] * 4
    info = store.get("a")
    assert info.disk_reads == 1 and info.loads == 1 and store.state().disk_reads == 1
    assert len(calls) == 2  # one load_tensors call per layer (the adapter touches both layers), on one thread
    assert len(set(calls)) == 1 and calls[0] not in {t.ident for t in threads}


def test_loading_never_blocks_requests_for_other_adapters(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store()
    store.register("warm", adapters["a"])
    store.register("cold", adapters["b"])
    store.ensure("warm")
    gate = threading.Event()
    real = reader_mod.load_tensors

    def stalled(*args: Any, **kwargs: Any) -> Any:
        gate.wait(10)  # a very slow disk
        return real(*args, **kwargs)

    monkeypatch.setattr(reader_mod, "load_tensors", stalled)
    assert store.request("cold") is False
    time.sleep(0.02)
    assert store.get("cold").state == "loading"
    for _ in range(100):  # the engine's per-step calls while the read hangs
        assert store.request("warm", pin=True) is True
        assert store.layer("warm", 0) is not None
        assert store.request("cold") is False
        store.unpin("warm")
    # Every call returned while the read was still held at the gate: none of them waited for it.
    assert not gate.is_set() and store.get("cold").state == "loading"
    gate.set()
    store.ensure("cold", timeout=30)
    assert store.get("cold").state == "device"


def test_a_load_waits_for_an_unpin_when_every_resident_adapter_is_pinned(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path]
) -> None:
    store = make_store(device_budget=ONE)
    store.register("a", adapters["a"])
    store.register("b", adapters["b"])
    store.ensure("a")
    assert store.request("a", pin=True) is True
    assert store.request("b") is False
    with pytest.raises(DeadlineExceeded):
        store.ensure("b", timeout=0.2)
    st = store.state()
    assert _tiers(st) == {"a": "device", "b": "loading"} and st.adapters["a"].pins == 1 and st.device_bytes == ONE
    store.unpin("a")
    store.ensure("b", timeout=30)
    st = store.state()
    assert _tiers(st) == {"a": "host", "b": "device"} and st.device_lru == ("b",)
    _check_budgets(st)


def test_failed_load_is_reported_and_others_keep_serving(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(adapters["a"], broken)
    store = make_store()
    store.register("broken", broken)
    store.register("b", adapters["b"])
    file = broken / "adapter_model.safetensors"
    with open(file, "r+b") as f:  # truncated after registration
        f.truncate(file.stat().st_size - 64)
    with pytest.raises(HeaderError, match="truncated") as info:
        store.ensure("broken", timeout=30)
    assert info.value.file == str(file.resolve())
    assert store.get("broken").state == "failed" and "truncated" in (store.get("broken").error or "")
    assert isinstance(store.failure("broken"), HeaderError)
    assert store.request("broken") is False  # failed stays failed: no retry storm from the engine's polling
    assert store.state().queued == () and store.get("broken").loads == 0
    store.ensure("b", timeout=30)  # the loader survived
    assert store.failure("b") is None and store.state().device_lru == ("b",)
    _check_budgets(store.state())
    shutil.copy(adapters["a"] / "adapter_model.safetensors", file)
    store.unregister("broken")
    store.register("broken", broken)
    store.ensure("broken", timeout=30)
    assert store.get("broken").state == "device"


def test_unregister_while_loading_drops_the_load(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    real = reader_mod.load_tensors

    def stalled(*args: Any, **kwargs: Any) -> Any:
        gate.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(reader_mod, "load_tensors", stalled)
    store = make_store()
    store.register("a", adapters["a"])
    assert store.request("a") is False
    time.sleep(0.02)
    store.unregister("a")
    gate.set()
    store.register("b", adapters["b"])
    store.ensure("b", timeout=30)  # the loader finished a's load first and threw it away
    st = store.state()
    assert list(st.adapters) == ["b"] and st.device_lru == ("b",) and st.device_bytes == ONE
    _check_budgets(st)


def test_no_file_handles_are_kept(make_store: Callable[..., AdapterStore], adapters: dict[str, Path]) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc")
    store = make_store()
    for name in "abc":
        store.register(name, adapters[name])
        store.ensure(name, timeout=30)
    targets = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            targets.add(os.readlink(f"/proc/self/fd/{fd}"))
    assert not any(t.endswith("adapter_model.safetensors") for t in targets)


def test_roots_and_bad_adapters_through_the_store(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path], tmp_path: Path
) -> None:
    store = make_store(roots=[adapters["a"].parent])
    store.register("a", adapters["a"])
    with pytest.raises(PermissionDenied):
        store.register("x", tmp_path)
    (tmp_path / "adapter_config.json").write_text("{")
    store2 = make_store()
    with pytest.raises(InvalidAdapter):
        store2.register("x", tmp_path)
    assert [i.id for i in store.list()] == ["a"] and store2.list() == []


def test_rank_mismatch_found_at_registration(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    folder = tmp_path / "r"
    shutil.copytree(adapters["a"], folder)
    rewrite_adapter_tensors(folder, lambda t: {k: v[:2] if "q_proj.lora_A" in k else v for k, v in t.items()})
    with pytest.raises(InvalidAdapter, match="rank"):
        make_store().register("r", folder)


def test_metrics(make_store: Callable[..., AdapterStore], adapters: dict[str, Path]) -> None:
    def value(name: str, **labels: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    before = {
        "hit": value("loraplex_adapter_cache_events_total", event="hit", tier="device"),
        "miss": value("loraplex_adapter_cache_events_total", event="miss", tier="device"),
        "evict": value("loraplex_adapter_cache_events_total", event="eviction", tier="device"),
        "host_hit": value("loraplex_adapter_cache_events_total", event="hit", tier="host"),
        "read": value("loraplex_adapter_read_bytes_total"),
    }
    store = make_store(device_budget=ONE, host_budget=2 * ONE)
    store.register("a", adapters["a"])
    store.register("b", adapters["b"])
    store.ensure("a")
    store.ensure("b")
    store.ensure("a")
    assert value("loraplex_adapter_cache_events_total", event="miss", tier="device") - before["miss"] == 3
    assert value("loraplex_adapter_cache_events_total", event="hit", tier="device") - before["hit"] == 3
    assert value("loraplex_adapter_cache_events_total", event="eviction", tier="device") - before["evict"] == 2
    assert value("loraplex_adapter_cache_events_total", event="hit", tier="host") - before["host_hit"] == 1
    assert value("loraplex_adapter_read_bytes_total") - before["read"] == 2 * ONE
    assert value("loraplex_adapter_resident_bytes", tier="device") == ONE
    assert value("loraplex_adapters_registered") == 2
    assert value("loraplex_adapter_load_duration_seconds_count", stage="total", tier="host") >= 1


@pytest.mark.gpu
def test_cuda_tiers(tiny_cfg: ModelConfig, base: Path, adapters: dict[str, Path]) -> None:
    device = torch.device("cuda")
    ref = _reference(adapters["rslora"], base)
    store = AdapterStore(
        tiny_cfg, device=device, dtype=torch.bfloat16, device_budget_bytes=1 << 20, host_budget_bytes=1 << 20
    )
    with store:
        store.register("r", adapters["rslora"])
        store.ensure("r", timeout=60)
        for layer in range(tiny_cfg.num_layers):
            lora = store.layer("r", layer)
            assert lora is not None
            for m, mod in lora.modules.items():
                assert mod.a.device.type == "cuda" and mod.a.dtype == torch.bfloat16
                torch.testing.assert_close(mod.a.float().cpu(), ref[(layer, m)][0], rtol=1e-2, atol=1e-2)
                torch.testing.assert_close(mod.b.float().cpu(), ref[(layer, m)][1], rtol=1e-2, atol=2e-2)
        entry = store._entries["r"]
        assert entry.host is not None and entry.host.buffer.is_pinned()


def test_a_resolved_adapter_object_pins_on_readiness_and_releases_its_pin(
    make_store: Callable[..., AdapterStore], adapters: dict[str, Path]
) -> None:
    from service.adapters.handle import Adapter
    from service.adapters.lora.part import LoraPart

    store = make_store()
    store.register("a", adapters["a"])
    part = LoraPart(store)
    claim = part.claim("a")
    first, second = Adapter("a", [claim]), Adapter("a", [part.claim("a")])
    assert not first.drafts() and not first.ready()
    first.load()  # queues the load; the pin is taken for it when the load completes
    deadline = time.monotonic() + 30
    while not first.ready() and time.monotonic() < deadline:
        time.sleep(0.01)
        first.load()
    assert first.ready() and claim.pinned and first.failure() is None and first.binding().deltas
    assert store.get("a").pins == 1 and first.kv_key() == ("a", store.get("a").registered_at)
    second.load()  # resident: pinned at once
    assert second.ready() and store.get("a").pins == 2
    first.release()
    first.release()  # a second release gives nothing back twice
    assert store.get("a").pins == 1 and not claim.pinned
    second.release()
    assert store.get("a").pins == 0
    waiting = Adapter("a", [part.claim("a")])
    waiting.release()  # never pinned: drops only its claim
    assert store.get("a").pins == 0
