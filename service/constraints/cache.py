"""Compiled grammars, kept by content under a byte budget: the first request with a schema compiles it, the next
ones start from the cached grammar.

Lookups are thread-safe and single-flight: two requests with the same new schema compile it once (the second
waits for the first's result, or its error). Entries are charged ``Grammar.nbytes`` and evicted least recently used
first once the budget is exceeded; a budget of 0 keeps nothing. Compiles run on the caller's thread (the
runtime's worker pool, never the event loop or the engine thread).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

from service import metrics
from service.constraints.backend import Backend, Grammar
from service.constraints.spec import Constraint


class GrammarCache:
    def __init__(self, backend: Backend, budget_bytes: int) -> None:
        self.backend = backend
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, Grammar] = OrderedDict()
        self._flights: dict[str, Future[Grammar]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, constraint: Constraint) -> Grammar:
        """The compiled grammar of ``constraint``. Raises what the backend raises (``InvalidRequest``)."""
        key = constraint.key
        with self._lock:
            grammar = self._entries.get(key)
            if grammar is not None:
                self._entries.move_to_end(key)
                metrics.CONSTRAINT_CACHE_LOOKUPS.labels("hit").inc()
                return grammar
            flight = self._flights.get(key)
            owner = flight is None
            if flight is None:
                flight = self._flights[key] = Future()
        if not owner:
            metrics.CONSTRAINT_CACHE_LOOKUPS.labels("hit").inc()  # compiled once, for both
            return flight.result()
        metrics.CONSTRAINT_CACHE_LOOKUPS.labels("miss").inc()
        start = time.perf_counter()
        try:
            grammar = self.backend.compile(constraint)
        except BaseException as exc:
            with self._lock:
                del self._flights[key]
            flight.set_exception(exc)
            raise
        finally:
            metrics.CONSTRAINT_COMPILE_SECONDS.observe(time.perf_counter() - start)
        with self._lock:
            del self._flights[key]
            self._keep(key, grammar)
        flight.set_result(grammar)
        return grammar

    def _keep(self, key: str, grammar: Grammar) -> None:
        if grammar.nbytes > self.budget_bytes:
            return  # never cached: it alone is over the budget
        self._entries[key] = grammar
        self._bytes += grammar.nbytes
        while self._bytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
        metrics.CONSTRAINT_CACHE_BYTES.set(self._bytes)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def keys(self) -> list[str]:
        """Cached constraint keys, least recently used first (for tests)."""
        with self._lock:
            return list(self._entries)


__all__ = ["GrammarCache"]
