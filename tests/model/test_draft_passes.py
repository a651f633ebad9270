"""Passes of several tokens a row on the compiled attention (``lp_decode_attention`` with its slots, and with a draft
tree's mask): a prefill, a draft chain and a draft tree, on the one-call step and on the per-op path, give each token
the bits the decode step after the tokens it sees gives. So speculation emits plain greedy decoding's tokens by
construction, for chains and trees alike, wherever the products are batch-invariant (here: 4-bit weights).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from support.native import compiled_kernels, kernels_mode
from support.stack_models import CPU, lora_layer, lora_tables, tiny_q4_model

from service.adapters.lora.batch import AdapterBatch
from service.drafters.tree import DraftTree
from service.model import KVCache, Llama
from service.model.load_folder import load_model

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def q4_model(tiny_llama_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Llama:
    return tiny_q4_model(tiny_llama_factory, tmp_path_factory.mktemp("q4"))


@pytest.fixture(scope="module")
def pairs_model(tiny_llama_factory: Callable[..., Path]) -> Llama:
    """A tiny bfloat16 Llama on weights in pairs (``Bf16Pairs``: batch-invariant at every row count)."""
    compiled_kernels()
    with kernels_mode("auto"):
        model: Llama = load_model(tiny_llama_factory(seed=6), dtype=torch.bfloat16, device="cpu", pairs=True)[0]
    return model


def _layers(model: Llama) -> dict[str, Any]:
    return {"x": lora_layer(model.cfg, 1), "y": lora_layer(model.cfg, 2, ("q_proj", "down_proj"))}


def _batch(model: Llama, rows: list[str | None], slot_start: int) -> AdapterBatch | None:
    layers = _layers(model)
    return AdapterBatch.build(rows, lambda a, layer: layers[a], lora_tables(model), slot_start=slot_start)


@contextmanager
def _way(model: Llama, how: str) -> Iterator[None]:
    """The passes inside run one way: ``one-call`` or ``steps`` (each on the one-call step), or ``per-op``."""
    calls = model.stack.calls
    model.stack.enabled = how != "per-op"
    try:
        yield
    finally:
        model.stack.enabled = True
    assert (model.stack.calls > calls) == (how != "per-op")


# --- a draft chain, a prefill -----------------------------------------------------------------------------------


def _chain_runs(model: Llama, rows: list[str | None], t: int, prefill: bool) -> list[torch.Tensor]:
    """Hidden states [B, T, hidden] and the cache after: a chain verified in one call (``prefill``: the tokens as a
    prefill, no tree), the same tokens as T decode steps, and the chain on the per-op path."""
    cfg, b = model.cfg, len(rows)
    gen = torch.Generator().manual_seed(11 + b)
    start = torch.tensor([3, 9, 0, 5][:b])[:, None]  # rows at different positions, the first position too
    tokens = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    init = torch.randn(KVCache(cfg, b + 1, 24, dtype=torch.float32, device=CPU).data.shape, generator=gen)
    chain, pos = None if prefill else torch.ones(t, t, dtype=torch.bool).tril(), start + torch.arange(t)
    out = []
    for how in ("one-call", "steps", "per-op"):
        cache = KVCache(cfg, b + 1, 24, dtype=torch.float32, device=CPU)
        cache.data.copy_(init)
        with _way(model, how):
            if how == "steps":
                hidden = torch.cat([model(tokens[:, i : i + 1], start + i, cache, 1, _batch(model, rows, 1),
                                          kv_len=int(start.max()) + i + 1) for i in range(t)], dim=1)  # fmt: skip
            else:
                hidden = model(tokens, pos, cache, 1, _batch(model, rows, 1), kv_len=int(pos.max()) + 1, tree=chain)
        out += [hidden, cache.data.clone()]
    return out


@pytest.mark.parametrize("prefill", [False, True], ids=["draft-chain", "prefill"])
@pytest.mark.parametrize(("rows", "t"), [([None], 5), ([None, "x", None], 3), (["x", "y", "x", None], 4)])
def test_a_draft_chain_in_one_call_is_decode_steps_bit_for_bit(
    q4_model: Llama, rows: list[str | None], t: int, prefill: bool
) -> None:
    chain, chain_cache, steps, steps_cache, per_op, per_op_cache = _chain_runs(q4_model, rows, t, prefill)
    assert torch.equal(chain, steps) and torch.equal(chain_cache, steps_cache)  # speculation is plain decoding
    # and the per-op path (a pass a neighbour keeps off the one call) attends on the same kernel: the same bits
    assert torch.equal(chain, per_op) and torch.equal(chain_cache, per_op_cache)


# --- a draft tree -----------------------------------------------------------------------------------------------

WIDE = DraftTree.parse("0;1;2;0.0;0.1;1.0;0.0.0", 3)  # 8 nodes with the root: three candidates after it
DEEP = DraftTree.parse("0;1;0.0;0.1;0.0.0;0.0.0.0;1.0", 4)  # 8 nodes, four deep


def _path(tree: DraftTree, node: int) -> list[int]:
    """The nodes from the root down to ``node``."""
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("how", ["one-call", "per-op"])
@pytest.mark.parametrize(
    ("rows", "trees"),
    [([None, None], "shared"), (["x", None, "y"], "shared"), (["y", None, "x", "x"], "per-row")],
)
def test_a_draft_tree_gives_each_node_the_decode_step_after_its_ancestors(
    q4_model: Llama, rows: list[str | None], trees: str, how: str
) -> None:
    _tree_against_paths(q4_model, rows, trees, how)


@pytest.mark.parametrize("how", ["one-call", "per-op"])
def test_a_draft_tree_in_bf16_pairs_gives_each_node_the_decode_step_after_its_ancestors(
    pairs_model: Llama, how: str
) -> None:
    _tree_against_paths(pairs_model, ["x", None, "y"], "per-row", how)


def _tree_against_paths(model: Llama, rows: list[str | None], trees: str, how: str) -> None:
    """Every row's 8 tree nodes in one pass: node i at cache position L + i, RoPE position L + depth(i), seeing the
    cache below L and its ancestors. Each node's hidden state and K/V are bit for bit those of decoding its path one
    token at a time from the same cache (that row alone, with its adapter); ``per-row``: rows of different trees
    ([B, T, T], as the engine passes drafters of different trees)."""
    cfg, b = model.cfg, len(rows)
    gen = torch.Generator().manual_seed(23 + b)
    row_trees = [WIDE if trees == "shared" or i % 2 == 0 else DEEP for i in range(b)]
    start = torch.tensor([3, 9, 0, 5][:b])[:, None]  # roots at different positions, the first position too
    tokens = torch.randint(0, cfg.vocab_size, (b, WIDE.size), generator=gen)
    init = torch.randn(KVCache(cfg, b + 1, 24, dtype=model.dtype, device=CPU).data.shape, generator=gen)
    mask = WIDE.visible if trees == "shared" else torch.stack([t.visible for t in row_trees])
    positions = start + torch.tensor([t.depths for t in row_trees])
    cache = KVCache(cfg, b + 1, 24, dtype=model.dtype, device=CPU)
    cache.data.copy_(init)
    with _way(model, how):
        hidden = model(tokens, positions, cache, 1, _batch(model, rows, 1), kv_len=int(start.max()) + WIDE.size,
                       tree=mask)  # fmt: skip
    for r, tree in enumerate(row_trees):
        root = int(start[r])
        for node in range(tree.size):
            path = _path(tree, node)
            ref = KVCache(cfg, b + 1, 24, dtype=model.dtype, device=CPU)
            ref.data.copy_(init)
            with _way(model, "steps"):
                for d, j in enumerate(path):
                    want = model(tokens[r : r + 1, j : j + 1], torch.tensor([[root + d]]), ref, 1 + r,
                                 _batch(model, rows[r : r + 1], 1 + r), kv_len=root + d + 1)  # fmt: skip
            assert torch.equal(hidden[r, node], want[0, 0]), (r, node)
            kv_tree = cache.data[:, :, 1 + r, :, root + node]  # [layers, 2, KV, D]: the node's K and V
            assert torch.equal(kv_tree, ref.data[:, :, 1 + r, :, root + len(path) - 1]), (r, node)
