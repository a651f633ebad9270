"""Draft trees: parsing, structure, greedy acceptance, and the model's tree attention against plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.drafters.tree import DraftTree
from service.model import KVCache
from service.model.load_folder import load_model


def test_parse_chain_and_paths() -> None:
    chain = DraftTree.parse("chain", 3)
    assert chain.paths == ((0,), (0, 0), (0, 0, 0)) and chain.size == 4 and chain.max_rank == 0
    tree = DraftTree.parse("0.0; 1 ;0;0.1;1.0;0.0.0;2", 3)
    assert tree.paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.depths == [0, 1, 1, 1, 2, 2, 2, 3] and tree.parents == [-1, 0, 0, 0, 1, 1, 2, 4]
    assert tree.max_rank == 2 and tree.nodes_within(1) == 4 and tree.nodes_within(0) == 1
    assert DraftTree.parse("0;1;0.0;0.0.0", 2).paths == ((0,), (1,), (0, 0))  # deeper than the heads: dropped
    vis = tree.visible
    assert vis[7].nonzero().flatten().tolist() == [0, 1, 4, 7] and vis[2].nonzero().flatten().tolist() == [0, 2]
    for bad in ("0;0.0.0", "0;0", "x", "0;-1"):
        with pytest.raises(ValueError):
            DraftTree.parse(bad, 3)


def test_accept_walks_the_argmax() -> None:
    tree = DraftTree.parse("0;1;0.0;1.0;0.0.0", 3)  # nodes: root, (0), (1), (0,0), (1,0), (0,0,0)
    # topk per head: head0 [10, 11], head1 [20], head2 [30]
    tokens = [99, *tree.tokens([[10, 11], [20, 21], [30]])]
    assert tokens == [99, 10, 11, 20, 20, 30]
    # model: after root -> 11 (node 2), after node 2 -> 20 (node 4), after node 4 -> 7 (no child)
    predicted = [11, 0, 20, 0, 7, 0]
    assert tree.accept(tokens, predicted.__getitem__, valid=6) == [2, 4]
    assert tree.accept(tokens, predicted.__getitem__, valid=3) == [2]  # node 4 not verified
    assert tree.accept(tokens, [5, 0, 0, 0, 0, 0].__getitem__, valid=6) == []


def test_tree_attention_matches_plain_decoding(tiny_llama_factory) -> None:  # type: ignore[no-untyped-def]
    """Feed a tree after a prompt; each node's logits equal decoding its path one token at a time."""
    folder: Path = tiny_llama_factory()
    model, cfg, _ = load_model(folder, dtype=torch.float32, device="cpu")
    tree = DraftTree.parse("0;1;2;0.0;0.1;1.0;0.0.0", 3)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    nodes = torch.randint(0, cfg.vocab_size, (2, tree.size - 1), generator=g)
    cache = KVCache(cfg, 2, 64, dtype=torch.float32, device=torch.device("cpu"))
    model(prompt, torch.arange(9).expand(2, 9), cache, 0)
    fed = torch.cat([torch.tensor([[5], [6]]), nodes], dim=1)  # root = pending token at position 9
    positions = 9 + torch.tensor(tree.depths)[None, :].expand(2, -1)
    got = model.logits(model(fed, positions, cache, 0, tree=tree.visible))  # [2, N, V]
    parents = tree.parents
    for b in range(2):
        for i in range(tree.size):
            path = []
            j = i
            while j >= 0:
                path.append(int(fed[b, j]))
                j = parents[j]
            seq = prompt[b].tolist() + path[::-1]
            ref_cache = KVCache(cfg, 1, 64, dtype=torch.float32, device=torch.device("cpu"))
            ids = torch.tensor([seq])
            want = model.logits(model(ids, torch.arange(len(seq))[None], ref_cache, 0)[:, -1])
            torch.testing.assert_close(got[b, i], want[0], atol=1e-4, rtol=0)
