"""Prefix caching: the block store on its own, the model after a restore, and the engine with it on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.engines import generate, idle, prompt, req, run, stepped_engine, tokens_of
from support.tiny_models import TINY_DEFAULTS

from service import metrics
from service.adapters.handle import MixtureKey, involves
from service.engine.engine import Engine
from service.engine.prefix import PrefixCache
from service.model import KVCache
from service.model.config import ModelConfig
from service.model.load_folder import load_model


def small_cache(slots: int = 4, max_len: int = 64) -> KVCache:
    cfg = ModelConfig.from_dict({**TINY_DEFAULTS, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    cache = KVCache(cfg, slots, max_len, dtype=torch.float32, device=torch.device("cpu"))
    cache.data.normal_(generator=torch.Generator().manual_seed(0))
    return cache


def block_bytes(cache: KVCache, block: int) -> int:
    layers, two, _, n_kv, _, d = cache.data.shape
    return layers * two * n_kv * block * d * 4


def test_lookup_restores_exactly_the_stored_blocks() -> None:
    cache = small_cache()
    prefix = PrefixCache(cache, 100 * block_bytes(cache, 4), block=4)
    tokens = list(range(100, 111))  # 11 tokens: 2 full blocks
    assert prefix.insert(tokens, None, slot=0, length=len(tokens)) == 2
    assert prefix.insert(tokens, None, slot=0, length=len(tokens)) == 0  # already there
    blocks = prefix.lookup([*tokens[:9], 7, 7], None)
    assert len(blocks) == 2
    assert prefix.restore(blocks, slot=3) == 8
    assert torch.equal(cache.data[:, :, 3, :, :8], cache.data[:, :, 0, :, :8])
    # limit, another key, a different token in the first block: fewer or no blocks
    assert len(prefix.lookup(tokens, None, limit=7)) == 1
    assert prefix.lookup(tokens, ("caps", 1.0)) == []
    assert prefix.lookup([0, *tokens[1:]], None) == []
    assert len(prefix.lookup([*tokens[:4], 0, *tokens[5:]], None)) == 1


def test_least_recently_used_blocks_are_evicted_and_long_chains_stay_consistent() -> None:
    cache = small_cache()
    prefix = PrefixCache(cache, 3 * block_bytes(cache, 4), block=4)
    assert prefix.capacity == 3
    a, b = list(range(1, 9)), list(range(50, 58))
    prefix.insert(a, None, 0, 8)
    prefix.insert(b, None, 1, 8)  # evicts a's first block (the least recently used)
    assert prefix.blocks_used == 3
    assert prefix.lookup(a, None) == []
    assert len(prefix.lookup(b, None)) == 2
    # A prompt longer than the whole cache keeps its first `capacity` blocks, each holding its own K/V.
    long = list(range(200, 220))  # 5 blocks
    assert prefix.insert(long, None, 2, 20) == 3
    blocks = prefix.lookup(long, None)
    assert len(blocks) == 3
    prefix.restore(blocks, 3)
    assert torch.equal(cache.data[:, :, 3, :, :12], cache.data[:, :, 2, :, :12])


def test_forget_drops_a_registrations_blocks_alone_scaled_and_in_mixtures() -> None:
    cache = small_cache()
    prefix = PrefixCache(cache, 100 * block_bytes(cache, 4), block=4)
    a, b = ("a", 1.0), ("b", 2.0)  # two registrations' keys
    keys = [None, a, b, MixtureKey(((a, 0.5),)), MixtureKey(((b, 0.5), (a, 0.5))), MixtureKey(((b, 0.5),))]
    for key in keys:
        prefix.insert(list(range(8)), key, slot=0, length=8)
    assert prefix.blocks_by_key() == dict.fromkeys(keys, 2)
    assert prefix.forget(lambda key: involves(key, a)) == 6
    assert prefix.blocks_by_key() == {None: 2, b: 2, MixtureKey(((b, 0.5),)): 2}
    assert not involves(("a", 1.0, "x"), a) and not involves((a, 0.5), a)  # only a mixture's key lists components


def test_zero_budget_turns_caching_off() -> None:
    cache = small_cache()
    prefix = PrefixCache(cache, 0)
    assert not prefix.enabled and prefix.nbytes == 0
    assert prefix.insert(list(range(40)), None, 0, 40) == 0
    assert prefix.lookup(list(range(40)), None) == []


def test_logits_after_a_restore_match_a_full_prefill(tiny_llama_factory) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_llama_factory()
    model, cfg, _ = load_model(folder, dtype=torch.float32, device="cpu")
    cache = KVCache(cfg, 2, 96, dtype=torch.float32, device=torch.device("cpu"))
    prefix = PrefixCache(cache, 1 << 24, block=8)

    def ids(seed: int, n: int) -> list[int]:  # within the tiny vocabulary
        return [t % cfg.vocab_size for t in prompt(seed, n)]

    shared = ids(1, 27)
    first, second = [*shared, *ids(2, 5)], [*shared, *ids(3, 9)]

    def full(ids: list[int], slot: int) -> torch.Tensor:
        t = torch.tensor([ids])
        pos = torch.arange(len(ids))[None]
        return model.logits(model(t, pos, cache, slot)[:, -1])

    full(first, 0)
    prefix.insert(first, None, 0, len(first))
    reference = full(second, 1)
    blocks = prefix.lookup(second, None, limit=len(second) - 1)
    n = prefix.restore(blocks, 1)
    assert n == 24
    rest = torch.tensor([second[n:]])
    pos = torch.arange(n, len(second))[None]
    cached = model.logits(model(rest, pos, cache, 1)[:, -1])
    torch.testing.assert_close(cached, reference, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def engines(served_tiny_dir: Path):  # type: ignore[no-untyped-def]
    limits = {"max_batch_size": 8, "max_total_tokens": 512, "max_prompt_tokens": 256}
    on = stepped_engine(served_tiny_dir, prefix_block_tokens=8, **limits)
    off = stepped_engine(served_tiny_dir, prefix_cache_bytes=0, **limits)
    yield on, off
    on.stop()
    off.stop()


def test_engine_output_is_the_same_with_and_without_prefix_caching(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    system = prompt(7, 45)  # a shared "system prompt", then different questions
    prompts = [[*system, *prompt(20 + i, 3 + 4 * i)] for i in range(6)] + [system[:30], system]
    hits = metrics.PREFIX_CACHE_HIT_TOKENS._value.get()
    for wave in range(2):  # the second wave finds every prompt cached; the first shares the system prompt
        for i, p in enumerate(prompts):
            got = tokens_of(generate(on, req(f"on{wave}-{i}", p, n=16)))
            want = tokens_of(generate(off, req(f"off{wave}-{i}", p, n=16)))
            assert got == want, f"wave {wave} prompt {i}"
    assert metrics.PREFIX_CACHE_HIT_TOKENS._value.get() - hits >= 40 * (2 * len(prompts) - 1)
    assert on.prefix.blocks_used > 0 and off.prefix.blocks_used == 0


def test_engine_batched_prefill_mixes_hits_and_misses(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    system = prompt(8, 33)
    generate(on, req("warm", [*system, 5], n=2))  # caches the system prompt's blocks
    prompts = [[*system, *prompt(40 + i, 2 + 9 * i)] for i in range(4)] + [prompt(60 + i, 7 + 13 * i) for i in range(3)]
    # Submitted together: one prefill with different cached lengths per row.
    results = run(on, *(req(f"mix{i}", p, n=12) for i, p in enumerate(prompts)))
    for i, p in enumerate(prompts):
        assert tokens_of(results[f"mix{i}"]) == tokens_of(generate(off, req(f"ref{i}", p, n=12))), i
    assert idle(on)
