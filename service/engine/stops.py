"""Stop sequences over streamed text: decide how much of each text delta is safe to send to the client.

A stop sequence can arrive split across deltas ("<|us" + "er|>"), so the matcher holds back the longest tail
of the text that could still grow into one, and releases it once it cannot. When a stop sequence completes,
the text before it is released and the match ends the stream: the stop sequence itself, and anything after
it, is never emitted. The first stop sequence to complete wins (as if the text arrived one character at a time),
so where the deltas happen to be cut never changes the result.

Cost per delta is O(len(delta) + longest stop sequence) string work, independent of how long the output is.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.errors import InvalidRequest

__all__ = ["StopMatcher"]


class StopMatcher:
    """Feed text deltas with ``push``; emit what it returns; ``flush`` at the end of the stream."""

    __slots__ = ("_held", "_max_len", "_prefixes", "_stopped", "matched", "stops")

    def __init__(self, stop_sequences: Sequence[str]) -> None:
        for i, s in enumerate(stop_sequences):
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"stop sequence {i} is empty; every stop sequence needs at least one character")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stop_sequences))
        self._max_len = max((len(s) for s in self.stops), default=0)
        # Every proper prefix of every stop: a text tail equal to one of these may still become a stop.
        self._prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop sequence that ended the stream

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def held(self) -> str:
        """Text received but not yet released (a possible beginning of a stop sequence)."""
        return self._held

    def push(self, delta: str) -> tuple[str, bool]:
        """Add a text delta. Returns (text safe to emit now, whether a stop sequence has completed).

        After a stop, every further push returns ("", True).
        """
        if self._stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta
        # Any match starts inside ``text``: an earlier start would have been held back as a stop's prefix.
        # The stop that completes first (ends earliest) wins, ties going to the one starting earlier (the
        # longer), so the outcome does not depend on how the text was cut into deltas.
        first, first_end = -1, 0
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0 and (first < 0 or (at + len(stop), at) < (first_end, first)):
                first, first_end, self.matched = at, at + len(stop), stop
        if first >= 0:
            self._stopped = True
            self._held = ""
            return text[:first], True
        keep = self._holdback(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """End of stream without a stop: release the held tail (it never completed a stop sequence)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _holdback(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop sequence."""
        for k in range(min(len(text), self._max_len - 1), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0
