"""Compiled grammars, kept by content under a byte budget: the first request with a schema compiles it, the next
ones start from the cached grammar.

Lookups are thread-safe and single-flight: two requests with the same new schema compile it once (the second
waits for the first's result, or its error). Entries are charged ``Grammar.nbytes`` and evicted least recently used
first once the budget is exceeded; a budget of 0 keeps nothing. A constraint that failed to compile is kept too
(charged ``FAILED_BYTES``), so sending a hostile schema again is refused at once instead of compiled again.
``submit`` compiles on the cache's own small pool (never the event loop, the engine thread or the tokenization
pool: a slow compile delays only other compiles); ``get`` compiles on the caller's thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NoReturn

from service import metrics
from service.constraints.backend import Backend, Grammar
from service.constraints.spec import Constraint
from service.errors import LoraplexError
from service.torch_threads import name_os_thread

FAILED_BYTES = 4 << 10  # what a remembered compile error is charged
COMPILE_WORKERS = 2  # one hostile compile never holds up every other one


class _Failed:
    """A compile error, kept in the cache like a grammar."""

    __slots__ = ("error",)
    nbytes = FAILED_BYTES

    def __init__(self, error: LoraplexError) -> None:
        self.error = error

    def start(self) -> NoReturn:
        raise self.error.fresh()


class GrammarCache:
    def __init__(self, backend: Backend, budget_bytes: int) -> None:
        self.backend = backend
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, Grammar | _Failed] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._flights: dict[str, Future[Grammar]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def submit(self, constraint: Constraint) -> Future[Grammar]:
        """``get`` on the cache's compile pool (a done future for a cached grammar)."""
        with self._lock:
            entry = self._entries.get(constraint.key)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    COMPILE_WORKERS, thread_name_prefix="loraplex-grammar", initializer=name_os_thread
                )
            pool = self._pool
        if entry is not None and not isinstance(entry, _Failed):
            done: Future[Grammar] = Future()
            done.set_result(self.get(constraint))
            return done
        return pool.submit(self.get, constraint)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def get(self, constraint: Constraint) -> Grammar:
        """The compiled grammar of ``constraint``. Raises what the backend raises (``InvalidRequest``), also for a
        constraint whose compile failed before."""
        key = constraint.key
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                metrics.CONSTRAINT_CACHE_LOOKUPS.labels("hit").inc()
                if isinstance(entry, _Failed):
                    raise entry.error.fresh()
                return entry
            flight = self._flights.get(key)
            owner = flight is None
            if flight is None:
                flight = self._flights[key] = Future()
        if not owner:
            metrics.CONSTRAINT_CACHE_LOOKUPS.labels("hit").inc()  # compiled once, for both
            try:
                return flight.result()
            except LoraplexError as exc:
                raise exc.fresh() from None
        metrics.CONSTRAINT_CACHE_LOOKUPS.labels("miss").inc()
        start = time.perf_counter()
        try:
            grammar = self.backend.compile(constraint)
        except Exception as exc:
            with self._lock:
                del self._flights[key]
                if isinstance(exc, LoraplexError):  # the constraint's own fault: refuse it at once next time
                    self._keep(key, _Failed(exc))
            flight.set_exception(exc)
            raise
        finally:
            metrics.CONSTRAINT_COMPILE_SECONDS.observe(time.perf_counter() - start)
        with self._lock:
            del self._flights[key]
            self._keep(key, grammar)
        flight.set_result(grammar)
        return grammar

    def _keep(self, key: str, grammar: Grammar | _Failed) -> None:
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
