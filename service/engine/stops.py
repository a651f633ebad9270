"""Stop sequences over streamed text: decide how much of each text delta is safe to send to the client.

A stop sequence can arrive split across deltas ("<|us" + "er|>"), so the matcher holds back the longest tail
of the text that could still grow into one, and releases it once it cannot. When a stop sequence completes,
the text before it is released and the match ends the stream: the stop sequence itself, and anything after
it, is never emitted. The first stop sequence to complete wins (as if the text arrived one character at a time;
of several completing at the same character, the longest), so where the deltas are cut never changes the result.

The matcher is an Aho-Corasick automaton over the stop sequences, laid out in flat arrays: memory is linear in
the stops' total length (a few bytes per character, never one string per prefix) and each character of a delta
costs amortised O(1) automaton moves, however long the stops or the output are.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence

from service.errors import InvalidRequest

__all__ = ["StopMatcher"]


class _Automaton:
    """Aho-Corasick over the stop sequences, one node per character of their concatenation.

    Node ``g`` (an index into ``text``, the stops joined) stands for the prefix of its stop that ends at ``g``;
    a prefix shared by several stops is owned by the first of them, and the later stops' copies of it are unused
    nodes. Moving on from node ``g`` with the next character of its own stop is ``g + 1`` (the chain); the few
    other edges (where stops diverge, and out of the root) live in dictionaries, at most one per stop.
    """

    __slots__ = ("depth", "fail", "first", "forks", "last", "root", "stop_at", "text", "word")

    def __init__(self, stops: Sequence[str]) -> None:
        self.text = "".join(stops)
        n = len(self.text)
        self.root = n
        self.depth = array("i", bytes(4 * (n + 1)))  # characters of the prefix a node stands for
        self.last = bytearray(n + 1)  # 1 where a node is the last character of its stop (no chain edge on)
        self.first: dict[str, int] = {}  # root -> node, by character
        self.forks: dict[tuple[int, str], int] = {}  # (node, character) -> node, off the chain
        self.stop_at: dict[int, str] = {}  # node -> the stop sequence it completes
        start = 0
        for stop in stops:
            for d in range(1, len(stop) + 1):
                self.depth[start + d - 1] = d
            self.last[start + len(stop) - 1] = 1
            self._insert(stop, start)
            start += len(stop)
        self.fail = array("i", [n]) * (n + 1)  # longest proper suffix of a node's prefix that is a node
        self.word = array("i", [-1]) * (n + 1)  # the longest stop ending at a node (itself or via fail), or -1
        self._link()

    def _insert(self, stop: str, start: int) -> None:
        node = self.root
        for d, ch in enumerate(stop):
            nxt = self.edge(node, ch)
            if nxt < 0:  # the rest of this stop is a chain of its own nodes
                if node == self.root:
                    self.first[ch] = start + d
                else:
                    self.forks[node, ch] = start + d
                node = start + len(stop) - 1
                break
            node = nxt
        self.stop_at.setdefault(node, stop)

    def edge(self, node: int, ch: str) -> int:
        """The trie child of ``node`` by ``ch``, or -1."""
        if node == self.root:
            return self.first.get(ch, -1)
        if not self.last[node] and self.text[node + 1] == ch:
            return node + 1
        return self.forks.get((node, ch), -1)

    def _link(self) -> None:
        """Failure and output links, breadth first (a node's links only depend on shallower nodes)."""
        root = self.root
        # Fork children, grouped by parent once, so that listing a node's children is not a scan of all forks.
        by_parent: dict[int, list[tuple[str, int]]] = {}
        for (parent, ch), child in self.forks.items():
            by_parent.setdefault(parent, []).append((ch, child))
        todo: deque[int] = deque(self.first.values())
        while todo:
            node = todo.popleft()
            if node in self.stop_at:
                self.word[node] = node
            elif self.fail[node] != root:
                self.word[node] = self.word[self.fail[node]]
            kids = by_parent.get(node, [])
            if not self.last[node]:
                kids = [(self.text[node + 1], node + 1), *kids]
            for ch, child in kids:
                f = self.fail[node]
                while True:
                    nxt = self.edge(f, ch)
                    if nxt >= 0 and nxt != child:
                        self.fail[child] = nxt
                        break
                    if f == root:
                        break  # fail[child] stays the root
                    f = self.fail[f]
                todo.append(child)

    def step(self, node: int, ch: str) -> int:
        """The automaton's move: the longest suffix of (node's prefix + ch) that is a node (the root if none)."""
        root = self.root
        while True:
            nxt = self.edge(node, ch)
            if nxt >= 0:
                return nxt
            if node == root:
                return root
            node = self.fail[node]


class _Buffer:
    """Held text as chunks with an offset into the first: taking from the front copies only what is taken, so a
    long held tail is never re-copied by every delta."""

    __slots__ = ("_chunks", "_offset", "size")

    def __init__(self) -> None:
        self._chunks: deque[str] = deque()
        self._offset = 0
        self.size = 0

    def append(self, text: str) -> None:
        if text:
            self._chunks.append(text)
            self.size += len(text)

    def take(self, count: int) -> str:
        """Remove and return the first ``count`` characters."""
        out = []
        self.size -= count
        while count > 0:
            head = self._chunks[0]
            rest = len(head) - self._offset
            if rest <= count:
                out.append(head[self._offset :] if self._offset else head)
                self._chunks.popleft()
                self._offset = 0
                count -= rest
            else:
                out.append(head[self._offset : self._offset + count])
                self._offset += count
                count = 0
        return "".join(out)

    def value(self) -> str:
        return "".join(self._chunks)[self._offset :]

    def clear(self) -> None:
        self._chunks.clear()
        self._offset = self.size = 0


class StopMatcher:
    """Feed text deltas with ``push``; emit what it returns; ``flush`` at the end of the stream."""

    __slots__ = ("_auto", "_held", "_node", "_stopped", "matched", "stops")

    def __init__(self, stop_sequences: Sequence[str]) -> None:
        for i, s in enumerate(stop_sequences):
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"stop sequence {i} is empty; every stop sequence needs at least one character")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stop_sequences))
        self._auto = _Automaton(self.stops)
        self._node = self._auto.root  # the longest tail of the text so far that could still become a stop
        self._held = _Buffer()  # exactly that tail's text
        self._stopped = False
        self.matched: str | None = None  # the stop sequence that ended the stream

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def held(self) -> str:
        """Text received but not yet released (a possible beginning of a stop sequence)."""
        return self._held.value()

    def push(self, delta: str) -> tuple[str, bool]:
        """Add a text delta. Returns (text safe to emit now, whether a stop sequence has completed).

        After a stop, every further push returns ("", True).
        """
        if self._stopped:
            return "", True
        if not self.stops:
            return delta, False
        auto, node, held = self._auto, self._node, self._held
        base = held.size
        for i, ch in enumerate(delta):
            node = auto.step(node, ch)
            hit = auto.word[node]
            if hit >= 0:
                # The match starts inside held + delta: the held text is the longest tail that could become a stop.
                stop = auto.stop_at[hit]
                held.append(delta)
                before = held.take(base + i + 1 - len(stop))
                held.clear()
                self._stopped, self.matched = True, stop
                return before, True
        self._node = node
        held.append(delta)
        return held.take(held.size - (auto.depth[node] if node != auto.root else 0)), False

    def flush(self) -> str:
        """End of stream without a stop: release the held tail (it never completed a stop sequence)."""
        held = self._held.take(self._held.size)
        self._node = self._auto.root
        return "" if self._stopped else held
