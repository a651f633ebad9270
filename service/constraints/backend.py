"""The constraint backend seam: what the engine asks of a compiled grammar and of one row's matcher.

A backend (``service.constraints.llg`` for llguidance) compiles a checked ``Constraint`` into a ``Grammar``,
shared by every request with the same constraint (``service.constraints.cache``); each row then walks its own
``Matcher``. The engine never sees which backend it runs: masks are filled into rows of one int32 bitmask
(bit ``t % 32`` of word ``t // 32`` set: token ``t`` allowed), on the mask thread, for many matchers at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from service.constraints.spec import Constraint


class Matcher(Protocol):
    """One row's position in its grammar. Every method runs on the engine thread or the mask thread, never both
    at once for one matcher."""

    def consume(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar does not allow it (the matcher is then in error)."""
        ...

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` consumed tokens."""
        ...

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order, the grammar allows from here (nothing is consumed)."""
        ...

    def fill_mask(self, address: int, nbytes: int) -> None:
        """Write the allowed next tokens at ``address`` (``nbytes`` of bitmask words)."""
        ...

    @property
    def finished(self) -> bool:
        """The grammar is complete and cannot go on: only end-of-sequence may follow."""
        ...

    @property
    def error(self) -> str:
        """Why the matcher failed (a limit hit mid-way, a token it did not allow); "" while it is sound."""
        ...


class Grammar(Protocol):
    """A compiled constraint: immutable, shared; ``start`` makes a fresh matcher for one row."""

    @property
    def nbytes(self) -> int:
        """What it is charged in the cache (an estimate: the backend's memory is outside Python's view)."""
        ...

    def start(self) -> Matcher: ...


class Backend(Protocol):
    """Compiles constraints for one tokenizer and vocabulary; fills many rows' masks in one call."""

    def compile(self, constraint: Constraint) -> Grammar:
        """A checked constraint -> its grammar. Raises ``InvalidRequest`` naming the problem (a bad schema,
        regex or grammar, or one over the backend's limits)."""
        ...

    def fill_masks(self, matchers: Sequence[tuple[Matcher, int]], address: int, row_bytes: int, rows: int) -> None:
        """Fill the mask of each ``(matcher, row)`` into row ``row`` of the bitmask at ``address``."""
        ...


__all__ = ["Backend", "Grammar", "Matcher"]
