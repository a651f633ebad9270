"""The drafter seam: what speculative decoding asks of a proposer, and what it gets back.

After each step the runner hands every drafter the rows it drafts for: their last kept hidden state (final-normed,
what the base ``lm_head`` reads) and their tokens so far (prompt + output, the pending token last). A drafter
returns one ``Draft`` per row: a tree (``service.drafters.tree``) and the token of its first nodes. The runner
verifies every row's draft in the next step's forward pass and keeps the longest path greedy decoding agrees with,
so a drafter only affects speed, never output. A drafter never touches the KV cache, the rows or the sampler, and
is called on the engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from service.drafters.tree import DraftTree
    from service.model.weights.protocol import EmbeddingTable


@dataclass(frozen=True, slots=True)
class Draft:
    """Candidate tokens for one row: ``tokens[i]`` is the token of node ``i + 1`` of ``tree`` (node 0, the root,
    is the row's pending token). Nodes past ``len(tokens)`` are not verified."""

    tree: DraftTree
    tokens: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.tokens)


class DraftSettings(Protocol):
    """The settings server-wide drafters are built from (``service.config.Settings`` has them all)."""

    @property
    def draft(self) -> str: ...

    @property
    def draft_ngram(self) -> int: ...

    @property
    def draft_tokens(self) -> int: ...


class DraftModel(Protocol):
    """What a drafter may ask of the base model (``service.model.llama.Llama`` has it)."""

    def draft_head(self, rows: int) -> Tensor | EmbeddingTable:
        """The [vocab, hidden] projection to draft ``rows`` states with (the ``lm_head``, maybe in a faster dtype, or
        a compact head itself: ``EmbeddingTable.project``)."""
        ...


class Drafter(Protocol):
    """Proposes drafts for a group of rows that share this drafter."""

    def propose(self, hidden: Tensor, history: Sequence[Sequence[int]], model: DraftModel) -> list[Draft | None]:
        """``hidden`` [B, H]: each row's last kept hidden state; ``history[b]``: row b's tokens so far (the pending
        token last); ``model``: the base model (for drafters that project with its vocabulary head). One draft (or
        None: nothing to propose) per row."""
        ...


__all__ = ["Draft", "DraftModel", "DraftSettings", "Drafter"]
