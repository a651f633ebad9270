"""Prompt lookup: drafts copied from the row's own text, with no weights.

Code edits, retrieval answers and "repeat this" prompts echo text the row has already seen. After each step the
drafter takes the last ``n`` tokens of the row's prompt + output (``n`` = ``--draft-ngram`` down to 1, longest
first), finds their most recent earlier occurrence, and proposes the up to ``--draft-tokens`` tokens that followed
it, as a chain. No match: no draft, and the row decodes plainly. Verification keeps only what greedy decoding
would have produced, so output is unchanged; the speculation governor turns drafting off where it does not pay.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from service.drafters.base import Draft, DraftModel, DraftSettings
from service.drafters.tree import DraftTree

if TYPE_CHECKING:
    from torch import Tensor


_ITEM = array("i").itemsize  # bytes per token in the searched buffer


class PromptLookupDrafter:
    """Proposes the continuation of the latest earlier match of a row's last ``ngram`` (or fewer) tokens."""

    def __init__(self, ngram: int, tokens: int) -> None:
        if ngram < 1 or tokens < 1:
            raise ValueError(f"ngram and tokens must be >= 1, got {ngram} and {tokens}")
        self.ngram = ngram
        self.tokens = tokens
        self.tree = DraftTree.parse("chain", tokens)

    @classmethod
    def from_settings(cls, settings: DraftSettings) -> PromptLookupDrafter:
        return cls(settings.draft_ngram, settings.draft_tokens)

    def propose(self, hidden: Tensor, history: Sequence[Sequence[int]], model: DraftModel) -> list[Draft | None]:
        out: list[Draft | None] = []
        for tokens in history:
            found = lookup(tokens, self.ngram, self.tokens)
            out.append(Draft(self.tree, found) if found else None)
        return out


def lookup(tokens: Sequence[int], ngram: int, limit: int) -> tuple[int, ...]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the last ``n`` tokens of ``tokens``,
    for the largest ``n <= ngram`` that occurs; () when none does."""
    data = array("i", tokens).tobytes()  # bytes.rfind does the search in C
    size = len(tokens)
    for n in range(min(ngram, size - 1), 0, -1):
        suffix = data[-n * _ITEM :]
        end = (size - 1) * _ITEM  # the match ends before the last token: something follows it
        pos = data.rfind(suffix, 0, end)
        while pos > 0 and pos % _ITEM:  # a match across token boundaries: look further back
            pos = data.rfind(suffix, 0, pos + len(suffix) - 1)
        if pos >= 0 and pos % _ITEM == 0:
            start = pos // _ITEM + n
            return tuple(tokens[start : start + limit])
    return ()


__all__ = ["PromptLookupDrafter", "lookup"]
