"""A drafter that knows the answer, for tests of verification (a drafter the runner has never heard of, registered
by one line in ``SERVER_DRAFTERS``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.drafters.base import Draft
from service.drafters.tree import DraftTree


class Oracle:
    """Knows each prompt's plain greedy output: proposes its next ``k`` tokens as a chain, the last one wrong, so
    every verification accepts ``k - 1``."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], k: int = 3) -> None:
        self.expected, self.tree = expected, DraftTree.parse("chain", k)

    def propose(self, hidden: torch.Tensor, history: Sequence[Sequence[int]], model: object) -> list[Draft | None]:
        out: list[Draft | None] = []
        for tokens in history:
            prompt_ids = next(p for p in self.expected if tuple(tokens[: len(p)]) == p)
            ahead = self.expected[prompt_ids][len(tokens) - len(prompt_ids) :][: self.tree.size - 1]
            out.append(Draft(self.tree, (*ahead[:-1], ahead[-1] ^ 1)) if ahead else None)
        return out
