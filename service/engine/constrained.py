"""Speculation under a constraint: the verified path of a constrained row never leaves its grammar.

Greedy verification walks a row's draft tree from the root, at each node taking the token decoding would pick
there; for a constrained row that is the most likely token the grammar allows after the node's path, so the walk
advances the row's matcher node by node (``ConstrainedWalk.predict``) and undoes it afterwards: the output
processor consumes the emitted tokens, as on a plain step. The emitted tokens are therefore exactly those of
plain constrained greedy decoding. Drafts are checked against the grammar before they are verified: a chain
draft is cut at its first token the grammar refuses (``trim_draft``), so no verification compute is spent past it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from service.constraints.backend import Matcher
from service.constraints.masks import Masks
from service.drafters.base import Draft
from service.engine.sampling import greedy

__all__ = ["ConstrainedWalk", "trim_draft"]


class ConstrainedWalk:
    """One row's walk over its verified nodes: ``logits`` [T, V] of the nodes fed."""

    __slots__ = ("_logits", "_masks", "_matcher", "picked")

    def __init__(self, masks: Masks, matcher: Matcher, logits: torch.Tensor) -> None:
        self._masks = masks
        self._matcher = matcher
        self._logits = logits
        self.picked: list[int | None] = []  # the token picked at each node walked; None: a dead end

    def predict(self, node: int) -> int | None:
        """The grammar's argmax after ``node``'s path (the walk's previous picks), consumed so the next node's mask
        follows it; None at a dead end, which ends the walk."""
        if self.picked and self.picked[-1] is None:
            return None
        token = self._allowed_argmax(self._logits[node])
        if token is not None and not self._matcher.consume(token):
            token = None  # the mask allowed it, the parser refused it: a backend limit was hit
        self.picked.append(token)
        return token

    def _allowed_argmax(self, logits: torch.Tensor) -> int | None:
        """The most likely token the matcher allows next, from one node's logits [V]; None at a dead end. The
        unmasked argmax, when allowed, is the masked one (ties go to the lowest id either way)."""
        if not self._masks.load(self._matcher):
            return None
        top = int(greedy(logits))
        return top if self._masks.allows(top) else int(greedy(self._masks.masked(logits)))

    def undo(self) -> None:
        """Put the matcher back where the walk started."""
        self._matcher.rollback(sum(1 for t in self.picked if t is not None))


def trim_draft(draft: Draft, matcher: Matcher) -> Draft:
    """A chain draft cut before its first token the grammar does not allow (a tree's nodes are checked by the
    walk); nothing is consumed."""
    parents = draft.tree.parents
    if any(parents[i] != i - 1 for i in range(1, len(draft.tokens) + 1)):
        return draft
    keep = matcher.valid_prefix(draft.tokens)
    return draft if keep == len(draft.tokens) else replace(draft, tokens=draft.tokens[:keep])
