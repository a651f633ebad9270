"""Draft trees: several candidates per Medusa head, verified together in one forward pass.

Node ``(r_1, .., r_d)`` is candidate ``r_d`` (0 = most likely) of head ``d - 1`` placed after its parent
``(r_1, .., r_{d-1})``: head ``h`` predicts the token ``h + 2`` positions after the hidden state it reads, which is
the token at depth ``h + 1`` below the pending root. ``"chain"`` is ``(0,), (0, 0), ...``: the top-1 chain, one node
per head. A tree spends verification compute on alternatives: with top-1 accuracy ``p`` per head a chain gains
``p + p^2 + ..`` tokens per step, while giving head 0 three candidates lifts the first factor to its top-3
accuracy. Every node of a tree is fed to the model at once: the row's pending token at cache position ``L`` and
node ``i`` at ``L + i``, with RoPE position ``L + depth(i)`` and attention to the cache below ``L`` and to its own
ancestors only (``visible``). Greedy acceptance walks from the root: at each node, the child whose token equals the
model's argmax there; the emitted tokens are the path's tokens and the argmax at its end, exactly plain greedy
decoding. The K/V of the accepted path are then moved to ``L + 1 .. L + a`` (a no-op for a chain).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

__all__ = ["DraftTree"]


@dataclass(frozen=True)
class DraftTree:
    paths: tuple[tuple[int, ...], ...]  # one per node but the root, in node order
    # depths, parents, max_rank and visible are derived once per tree (cached_property): the engine reads them at
    # every speculative step.

    @classmethod
    def parse(cls, spec: str, num_heads: int) -> DraftTree:
        """``"chain"`` or ``;``-separated paths of ``.``-separated ranks; paths deeper than ``num_heads`` are
        dropped (an adapter with fewer heads uses the top of the same tree)."""
        spec = spec.strip()
        if spec == "chain":
            paths = [tuple([0] * d) for d in range(1, num_heads + 1)]
        else:
            try:
                paths = [tuple(int(r) for r in p.split(".")) for p in spec.split(";") if p.strip()]
            except ValueError:
                raise ValueError(f"draft tree {spec!r}: expected 'chain' or paths like '0;1;0.0'") from None
        return cls.from_paths([p for p in paths if len(p) <= num_heads])

    @classmethod
    def from_paths(cls, paths: Sequence[tuple[int, ...]]) -> DraftTree:
        if any(len(p) == 0 or min(p) < 0 for p in paths):
            raise ValueError("every tree path needs at least one rank, each >= 0")
        if len(set(paths)) != len(paths):
            raise ValueError("tree paths must be distinct")
        have = set(paths)
        for p in paths:
            if len(p) > 1 and p[:-1] not in have:
                raise ValueError(f"tree path {p} has no parent {p[:-1]}")
        return cls(tuple(sorted(paths, key=lambda p: (len(p), p))))

    @property
    def size(self) -> int:
        return len(self.paths) + 1

    @cached_property
    def depths(self) -> list[int]:
        return [0] + [len(p) for p in self.paths]

    @cached_property
    def parents(self) -> list[int]:
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return [-1] + [index.get(p[:-1], 0) for p in self.paths]

    @cached_property
    def max_rank(self) -> int:
        return max((r for p in self.paths for r in p), default=0)

    @cached_property
    def visible(self) -> Tensor:
        parents = self.parents
        out = torch.zeros(self.size, self.size, dtype=torch.bool)
        for i in range(self.size):
            j = i
            while j >= 0:
                out[i, j] = True
                j = parents[j]
        return out

    def nodes_within(self, depth: int) -> int:
        return bisect_right(self.depths, depth)  # depths are sorted: nodes come in order of depth

    def tokens(self, topk: Sequence[Sequence[int]]) -> list[int]:
        """``topk[h][r]``: head h's rank-r token -> the token of every node but the root, in node order."""
        return [topk[len(p) - 1][p[-1]] for p in self.paths]

    def accept(self, tokens: Sequence[int], predict: Callable[[int], int | None], valid: int) -> list[int]:
        """Nodes ``1 .. valid-1`` carry ``tokens[i]``; ``predict(i)`` is the token decoding picks after node i's
        path (called once per node on the walk, root first; None: nothing may follow). Returns the accepted nodes
        from the root down (empty: nothing accepted)."""
        parents = self.parents
        path: list[int] = []
        node = 0
        while True:
            want = predict(node)
            nxt = next((c for c in range(1, valid) if parents[c] == node and tokens[c] == want), None)
            if nxt is None:
                return path
            path.append(nxt)
            node = nxt
