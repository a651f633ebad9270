"""A decode step in one compiled call (``service.model.decode_stack``, ``src/decode.cpp``) against the per-op path it
replaces: the same hidden states and the same cache, bit for bit, on a tiny all-Q4 GGUF and on the default model;
where it does not apply it stays out; a replaced projection is seen; the self-check drops a wrong stack.

The per-op path itself is proven against transformers (test_gguf_model.py, test_gguf_smollm2.py) and its ops against
float64 (test_fused_step.py); this file proves that the one call composes them the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.gguf_files import load_variant
from support.native import compiled_kernels, kernels_mode
from support.stack_models import CPU, load_q4, lora_layer, lora_tables, tiny_q4_model

from service.adapters.lora.batch import AdapterBatch, LoraTables
from service.adapters.lora.types import LoraLayer
from service.model import KVCache, Llama
from service.model.decode_stack import DecodeStack
from service.model.load_folder import load_model
from service.model.step import make_step
from service.model.weights.bf16_pairs import Bf16Pairs
from service.model.weights.protocol import native_dense_rows
from service.model.weights.q4_native import Q4Native
from service.selfcheck import run_self_check

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def q4_model(tiny_llama_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Llama:
    return tiny_q4_model(tiny_llama_factory, tmp_path_factory.mktemp("q4"))


def _decode(model: Llama, *, stack: bool, rows: int, slot_start: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` decode steps of ``rows`` rows at slots ``slot_start ..`` of a cache holding random values (the
    other slots too): the hidden states of every step and the cache after them."""
    gen = torch.Generator().manual_seed(rows)
    cache = KVCache(model.cfg, slot_start + rows + 1, 24, dtype=model.dtype, device=torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    start = torch.tensor([3, 11, 0, 7, 5, 2, 9][:rows])[:, None]  # rows at different positions, the first position too
    model.stack.enabled = stack
    try:
        hidden = []
        for i in range(steps):
            tokens = torch.randint(0, model.cfg.vocab_size, (rows, 1), generator=gen)
            pos = start + i
            hidden.append(model(tokens, pos, cache, slot_start, kv_len=int(pos.max()) + 1))
    finally:
        model.stack.enabled = True
    return torch.cat(hidden, dim=1), cache.data.clone()


@pytest.mark.parametrize(("rows", "slot_start"), [(1, 0), (3, 2), (4, 1)])
def test_one_call_is_the_per_op_path_bit_for_bit(q4_model: Llama, rows: int, slot_start: int) -> None:
    calls = q4_model.stack.calls
    fused, fused_cache = _decode(q4_model, stack=True, rows=rows, slot_start=slot_start, steps=4)
    assert q4_model.stack.calls == calls + 4  # every step ran as one call
    per_op, per_op_cache = _decode(q4_model, stack=False, rows=rows, slot_start=slot_start, steps=4)
    assert q4_model.stack.calls == calls + 4
    assert torch.equal(fused, per_op)
    assert torch.equal(fused_cache, per_op_cache)  # the rows' slots written alike, the other slots untouched


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16, "bf16 pairs"], ids=str)
def dense_model(request: pytest.FixtureRequest, tiny_llama_factory: Callable[..., Path]) -> Llama:
    """A tiny Llama on its dense weights (the model folder), float32 or bfloat16, or bf16 in pairs (``Bf16Pairs``,
    on the CPU's bf16 dot products or the portable code of the same arithmetic)."""
    compiled_kernels()
    pairs = request.param == "bf16 pairs"
    dtype = torch.bfloat16 if pairs else request.param
    with kernels_mode("auto"):
        model: Llama = load_model(tiny_llama_factory(seed=6), dtype=dtype, device="cpu", pairs=pairs)[0]
    assert isinstance(model.projection(0, "wqkv"), Bf16Pairs) == pairs
    return model


@pytest.mark.parametrize(("rows", "slot_start"), [(1, 0), (3, 2), (7, 1)])
def test_dense_weights_in_one_call_are_the_per_op_path_bit_for_bit(
    dense_model: Llama, rows: int, slot_start: int
) -> None:
    """Dense projections (float32, bf16) take the dense kernel inside the call, as ``protocol.linear`` does up to
    ``native_dense_rows``; beyond, the per-op path and torch's GEMM. Weights in pairs take their kernel at every
    row count, in the call and out of it."""
    pairs = isinstance(dense_model.projection(0, "wqkv"), Bf16Pairs)
    one_call = pairs or rows <= native_dense_rows(dense_model.dtype, dense_model.native)
    calls = dense_model.stack.calls
    fused, fused_cache = _decode(dense_model, stack=True, rows=rows, slot_start=slot_start, steps=3)
    assert dense_model.stack.calls == calls + (3 if one_call else 0)
    per_op, per_op_cache = _decode(dense_model, stack=False, rows=rows, slot_start=slot_start, steps=3)
    assert torch.equal(fused, per_op) and torch.equal(fused_cache, per_op_cache)
    many = native_dense_rows(dense_model.dtype, dense_model.native) + 1
    assert (dense_model.stack.plan(_step(dense_model, many), None, many) is None) != pairs


# --- LoRA rows: the compiled tables inside the one call ---------------------------------------------------------


def _lora_rows_both_ways(model: Llama, rows: list[str | None], mode: str) -> None:
    """Three decode steps of ``rows`` with LoRA tables through the one call and the per-op path (bit-equal), and
    through the one call without adapters (rows without an adapter unchanged, the others not)."""
    cfg = model.cfg
    layers = {
        "x": lora_layer(cfg, 1),
        "y": lora_layer(cfg, 2, ("v_proj", "o_proj", "down_proj")),
        "z": lora_layer(cfg, 3),
    }
    gen = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, cfg.vocab_size, (len(rows), 1), generator=gen) for _ in range(3)]
    runs = []
    for stack, adapters in ((True, rows), (False, rows), (True, [None] * len(rows))):
        tables, calls = lora_tables(model), model.stack.calls
        cache = KVCache(cfg, len(rows) + 1, 16, dtype=model.dtype, device=CPU)
        model.stack.enabled = stack
        try:
            hidden = []
            for p, tok in enumerate(tokens):
                batch = AdapterBatch.build(adapters, lambda a, layer: layers[a], tables, slot_start=1, mode=mode)
                hidden.append(model(tok, torch.full((len(rows), 1), p), cache, 1, batch, kv_len=p + 1))
        finally:
            model.stack.enabled = True
        assert model.stack.calls == calls + (len(tokens) if stack else 0)
        runs.append((torch.cat(hidden, dim=1), cache.data.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    for b, adapter in enumerate(rows):  # against the base model: rows without an adapter unchanged, the others not
        assert torch.equal(runs[0][0][b], runs[2][0][b]) == (adapter is None), b


@pytest.mark.parametrize("mode", ["shared", "slots"])
def test_lora_rows_in_one_call_are_the_per_op_path_bit_for_bit(q4_model: Llama, mode: str) -> None:
    _lora_rows_both_ways(q4_model, [None, "x", "y", None, "x", "z"], mode)  # rows without one inside and outside


@pytest.mark.parametrize("mode", ["shared", "slots"])
def test_lora_rows_on_dense_weights_in_one_call_are_the_per_op_path_bit_for_bit(dense_model: Llama, mode: str) -> None:
    _lora_rows_both_ways(dense_model, [None, "x", "y", "x"], mode)  # within the dense kernel's rows in bf16 too


@pytest.mark.parametrize("mode", ["slots", "shared"])
def test_the_same_rows_reuse_their_compiled_stack_until_a_table_changes(q4_model: Llama, mode: str) -> None:
    """The engine's batches name their rows' owners (requests): a batch of the same owners on unchanged tables
    takes the last step's compiled stack without looking up a layer; a table written in between (another batch's
    adapter in their slot, another set built) or other owners make it sync again, and every result is the one a
    fresh batch gives."""
    cfg, top = q4_model.cfg, q4_model.cfg.num_layers
    layers = {"x": lora_layer(cfg, 1), "y": lora_layer(cfg, 2, ("v_proj", "down_proj")), "z": lora_layer(cfg, 3)}
    looked: list[int] = []

    def lookup(adapter: str, layer: int) -> LoraLayer:
        looked.append(layer)
        return layers[adapter]

    tables = lora_tables(q4_model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 1), generator=torch.Generator().manual_seed(9))

    def step(rows: list[str], owners: tuple[object, ...] | None) -> torch.Tensor:
        nonlocal stack
        looked.clear()
        cache = KVCache(cfg, 2, 8, dtype=torch.float32, device=CPU)
        batch = AdapterBatch.build(rows, lookup, tables, mode=mode, owners=owners)
        out = q4_model(tokens[: len(rows)], torch.full((len(rows), 1), 3), cache, 0, batch, kv_len=4)
        assert batch is not None
        stack = batch.stack_lora()  # what the step took (kept: no layer looked up again)
        return out

    def layers_looked() -> int:
        return sum(layer < top for layer in looked)

    first, second, stack = object(), object(), None
    want = step(["x", "y"], (first, second))
    assert layers_looked() > 0 and stack is not None
    made = stack
    assert torch.equal(step(["x", "y"], (first, second)), want)
    assert layers_looked() == 0 and stack is made  # reused: no layer looked up
    step(["z"], None)  # z's weights written into slot 0 (or a set of z built) by a batch that keeps no stack
    assert torch.equal(step(["x", "y"], (first, second)), want)
    assert layers_looked() > 0  # synced again
    assert torch.equal(step(["x", "y"], (object(), second)), want)
    assert layers_looked() > 0  # another owner: synced again


def _steps_with_lora(model: Llama, rows: list[str | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two decode steps of ``rows`` (some with LoRA tables) through the one call: hidden states and the cache."""
    cfg = model.cfg
    layers = {"x": lora_layer(cfg, 1), "y": lora_layer(cfg, 2, ("q_proj", "gate_proj", "down_proj"))}
    gen = torch.Generator().manual_seed(5)
    cache = KVCache(cfg, len(rows), 24, dtype=model.dtype, device=CPU)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    start = torch.tensor([3, 11, 0, 7, 5, 2, 9, 4, 6][: len(rows)])[:, None]
    tables, calls, hidden = lora_tables(model), model.stack.calls, []
    for i in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (len(rows), 1), generator=gen)
        batch = AdapterBatch.build(rows, lambda a, layer: layers[a], tables)
        hidden.append(model(tokens, start + i, cache, 0, batch, kv_len=int(start.max()) + i + 1))
    assert model.stack.calls == calls + 2
    return torch.cat(hidden, dim=1), cache.data.clone()


def _same_bits_at(model: Llama, threads: int) -> None:
    dense = not isinstance(model.projection(0, "wqkv"), (Q4Native, Bf16Pairs))  # in the call up to its rows
    n = native_dense_rows(model.dtype, model.native) if dense else 9
    rows = ["x", None, "y", "x", "y", "y", None, "x", "x"][:n]
    want = _decode(model, stack=True, rows=min(n, 7), slot_start=0, steps=2), _steps_with_lora(model, rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(3):
            got = _decode(model, stack=True, rows=min(n, 7), slot_start=0, steps=2), _steps_with_lora(model, rows)
            for (w_hidden, w_cache), (g_hidden, g_cache) in zip(want, got, strict=True):
                assert torch.equal(w_hidden, g_hidden) and torch.equal(w_cache, g_cache)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_same_bits_at_any_thread_count(q4_model: Llama, threads: int) -> None:
    """The kernels share a call's work items among its threads (src/shares.h: each thread its static share in
    order, then items from the back of the others'): which thread runs an item never changes a result. One thread
    takes every share (the others' from their backs); three threads on this machine's cores take each other's
    items whenever one waits for a core."""
    _same_bits_at(q4_model, threads)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_same_bits_at_any_thread_count_on_dense_weights(dense_model: Llama, threads: int) -> None:
    _same_bits_at(dense_model, threads)


def test_the_default_model_takes_it_at_one_row(smollm2_dir: Path, smollm2_gguf: Path) -> None:
    model = load_q4(smollm2_dir, smollm2_gguf)
    fused, fused_cache = _decode(model, stack=True, rows=1, slot_start=0, steps=3)
    assert model.stack.calls == 3
    per_op, per_op_cache = _decode(model, stack=False, rows=1, slot_start=0, steps=3)
    assert torch.equal(fused, per_op) and torch.equal(fused_cache, per_op_cache)


def _step(model: Llama, rows: int, tokens: int = 1, adapters: Any = None, tree: torch.Tensor | None = None) -> Any:
    cache = KVCache(model.cfg, rows, 8, dtype=torch.float32, device=torch.device("cpu"))
    positions = torch.arange(tokens).repeat(rows, 1)
    tables = (model._cos, model._sin)
    return make_step(tables, positions, positions, tokens, cache=cache, slot_start=0, heads_per_kv=1, tree=tree,
                     adapters=adapters, scratch=model.scratch, native=model.native)  # fmt: skip


def test_it_stays_out_of_what_it_does_not_compute(q4_model: Llama) -> None:
    stack = q4_model.stack
    q4_model._rope_for(8)
    w_norm = torch.ones(q4_model.cfg.hidden_size)
    assert stack.plan(_step(q4_model, 2), None, 2) is not None
    assert stack.plan(_step(q4_model, 2, tokens=3), None, 2) is not None  # a prefill: T decode steps in one call
    both = torch.ones(2, 2, dtype=torch.bool)  # a tree's mask (here: each node seeing the other too)
    assert stack.plan(_step(q4_model, 1, tokens=2, tree=both), None, 1) is not None
    assert stack.plan(_step(q4_model, 1, tokens=2, tree=both.triu(1)), None, 1) is None  # a node blind to itself
    chain = torch.ones(3, 3, dtype=torch.bool).tril()  # a draft chain: T decode steps in one call
    assert stack.plan(_step(q4_model, 2, tokens=3, tree=chain), None, 2) is not None
    w13 = q4_model.projection(0, "w13")
    assert (
        isinstance(w13, Q4Native)
        and stack.plan(
            _step(q4_model, w13.dense_from_rows // 3 + 1, tokens=3, tree=chain), None, w13.dense_from_rows // 3 + 1
        )
        is None
    )
    eager_tables = LoraTables(q4_model.cfg, device=CPU, dtype=torch.float32, native=None)
    eager = AdapterBatch.build(["x", None], lambda a, layer: lora_layer(q4_model.cfg, 1), eager_tables)
    assert stack.plan(_step(q4_model, 2), eager, 2) is None  # adapters without compiled tables
    saved = LoraLayer(modules=lora_layer(q4_model.cfg, 1).modules, nbytes=0, saved={"post_attention_layernorm": w_norm})
    normed = AdapterBatch.build(["x", None], lambda a, layer: saved, lora_tables(q4_model))
    assert stack.plan(_step(q4_model, 2), normed, 2) is None  # a replaced norm weight
    w = q4_model.projection(0, "w13")
    assert isinstance(w, Q4Native)
    assert stack.plan(_step(q4_model, w.dense_from_rows), None, w.dense_from_rows) is None  # a dense matmul's rows
    native = q4_model.native
    q4_model.native = None  # the self-check dropped the step ops
    try:
        assert stack.plan(_step(q4_model, 2), None, 2) is None
    finally:
        q4_model.native = native


@pytest.mark.parametrize("variant", ["mixed", "tied"])
def test_a_model_with_dense_and_q4_weights_takes_it_and_biases_keep_the_per_op_path(
    variant: str, tiny_llama_factory: Callable[..., Path], tmp_path: Path
) -> None:
    compiled_kernels()
    model = load_variant(variant, tiny_llama_factory, tmp_path)  # mixed: Q8_0 / F16 projections; tied: biases
    fused, fused_cache = _decode(model, stack=True, rows=2, slot_start=0, steps=2)
    if variant == "tied":  # biases: the per-op path
        assert model.stack.calls == 0
        return
    kinds = {type(model.projection(0, name)).__name__ for name in ("wqkv", "wo", "w13", "w2")}
    assert kinds == {"Q4Native", "Tensor"} and model.stack.calls == 2  # dense and Q4 side by side in one call
    per_op, per_op_cache = _decode(model, stack=False, rows=2, slot_start=0, steps=2)
    assert torch.equal(fused, per_op) and torch.equal(fused_cache, per_op_cache)


def test_a_replaced_projection_is_seen(q4_model: Llama) -> None:
    w = q4_model.projection(1, "wo")
    assert isinstance(w, Q4Native)
    before, _ = _decode(q4_model, stack=True, rows=2, slot_start=0, steps=1)
    q4_model.set_projection(1, "wo", dataclasses.replace(w, d=w.d * 2))
    try:
        fused, _ = _decode(q4_model, stack=True, rows=2, slot_start=0, steps=1)
        per_op, _ = _decode(q4_model, stack=False, rows=2, slot_start=0, steps=1)
    finally:
        q4_model.set_projection(1, "wo", w)
    assert torch.equal(fused, per_op) and not torch.equal(fused, before)


def test_the_self_check_drops_a_stack_that_disagrees(q4_model: Llama, monkeypatch: pytest.MonkeyPatch) -> None:
    report = run_self_check(q4_model)
    assert [c.status for c in report.checks if c.path == "decode step in one call"] == ["ok"]
    run = DecodeStack.run
    monkeypatch.setattr(DecodeStack, "run", lambda self, *a: run(self, *a) * (1 + 2**-20))  # off in the last bits
    report = run_self_check(q4_model)
    try:
        assert [c.status for c in report.checks if c.path == "decode step in one call"] == [
            "fallback: the fused step ops one call at a time"
        ]
        assert not q4_model.stack.enabled and q4_model.native is not None  # the ops themselves stay
        q4_model._rope_for(8)
        assert q4_model.stack.plan(_step(q4_model, 1), None, 1) is None
    finally:
        q4_model.stack.enabled = True
