"""The scheduler: pure policy over request state, deciding what each engine step does.

Each step it retires cancelled and expired rows, plans one prefill pass and says whether rows with a drafter
(their adapter's Medusa heads, or the server's ``--draft``) draft for the next step (the speculation governor
decides). The prefill pass continues the row that is part-way through its prompt, then admits waiting rows into
free KV slots in arrival order (under the batch size and adapter readiness; a row whose adapter is still loading
never holds up rows behind it), all under one budget of padded prompt tokens: ``--prefill-chunk-tokens`` (a long
prompt then takes several steps, one chunk each, and the running rows decode between the chunks), or with chunking
off ``PREFILL_TOKEN_BUDGET`` and whole prompts only.
It returns a ``StepPlan``; the runner executes it and the output processor delivers the results.

Invariants: rows holding KV slots are compacted in slots ``0..n-1`` (``running[i]`` lives in slot ``i``), rows
that decode first, rows part-way through their prompt (``Row.prefilling``) after them. A pass runs a contiguous
run of the prefilling rows from the first, and every row of it but the last completes its prompt, so the rows it
completes join the decoding rows where they are. When rows retire, rows beyond the new end of their group move
into the holes through the injected ``move(src, dst, length)`` (the KV cache's). The scheduler imports no torch
and never touches tensors, so tests step it with fake rows and adapters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.engine.governor import SpeculationGovernor
from service.engine.request import FinishReason
from service.engine.row import Row
from service.errors import LoraplexError

if TYPE_CHECKING:
    from service.drafters.base import Drafter

# Padded prompt tokens one prefill pass may hold: bounds the prefill's activation memory and the time running
# streams wait while newcomers are prefilled.
PREFILL_TOKEN_BUDGET = 8192

Move = Callable[[int, int, int], None]  # (src_slot, dst_slot, length): the KV cache's slot move
# (prompt ids, K/V key) -> prompt tokens the prefix cache holds for them: the runner's lookup
Cached = Callable[[Sequence[int], Hashable], int]


@dataclass(frozen=True)
class StepPlan:
    """What one step does. Retired and failed rows have left the running set and the waiting queue already."""

    retired: tuple[tuple[Row, FinishReason], ...]  # cancelled / past their deadline
    failed: tuple[tuple[Row, LoraplexError], ...]  # their adapter cannot load
    prefill: tuple[Row, ...]  # rows of this step's prefill pass, in slots ``prefill_start ..`` (newcomers last)
    # Prompt tokens each row computes past what its slot holds once its cached blocks are in (the budget's count);
    # every row but the last completes its prompt whatever its count says.
    prefill_tokens: tuple[int, ...]
    prefill_start: int
    draft: bool  # rows with a drafter draft for the next step


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int
    speculate_max_batch: int
    speculate_adaptive: bool
    prefill_token_budget: int = PREFILL_TOKEN_BUDGET  # whole prompts per pass while chunking is off
    prefill_chunk_tokens: int = 0  # padded prompt tokens per pass, long prompts split; 0 = chunking off


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        move: Move,
        governor: SpeculationGovernor | None = None,
        cached: Cached | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.limits = limits
        self.governor = governor if governor is not None else SpeculationGovernor()
        self._move = move
        self._cached = cached
        self._drafter = drafter  # the server's drafter (--draft) for greedy rows whose adapter brings none
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []

    def add(self, row: Row) -> None:
        self.waiting.append(row)

    def schedule(self, now: float) -> StepPlan:
        retired = self._retire(now)
        self.compact()
        failed: list[tuple[Row, LoraplexError]] = []
        start = self.decoding
        rows, tokens, whole = self._plan_prefill(failed)
        draft = self.drafting(start + len(rows) - (0 if whole else 1))  # the rows that decode at this step
        return StepPlan(tuple(retired), tuple(failed), tuple(rows), tuple(tokens), start, draft)

    @property
    def decoding(self) -> int:
        """Rows that decode (slots ``0 ..``); the rows after them are part-way through their prompts."""
        n = 0
        while n < len(self.running) and not self.running[n].prefilling:
            n += 1
        return n

    def _retire(self, now: float) -> list[tuple[Row, FinishReason]]:
        retired: list[tuple[Row, FinishReason]] = []
        for row in [*self.waiting, *self.running]:
            deadline = row.request.deadline
            if row.handle.cancelled:
                retired.append((row, FinishReason.CANCELLED))
            elif deadline is not None and now > deadline:
                retired.append((row, FinishReason.DEADLINE))
            else:
                continue
            row.done = True
        if retired:
            self.waiting = deque(r for r in self.waiting if not r.done)
        return retired

    def _plan_prefill(self, failed: list[tuple[Row, LoraplexError]]) -> tuple[list[Row], list[int], bool]:
        """The prefill pass: the rows part-way through their prompts first, then newcomers admitted into free slots
        in arrival order, skipping rows whose adapter is not ready, each granted its tokens by ``_grant``; the pass
        ends after the first row granted less than the rest of its prompt. Also: whether its last row completes."""
        rows: list[Row] = []
        tokens: list[int] = []
        for row in self.running[self.decoding :]:
            grant = self._grant(row.remaining, tokens)
            if grant == 0:
                return rows, tokens, True  # no newcomer may run ahead of a row that holds a slot
            rows.append(row)
            tokens.append(grant)
            if grant < row.remaining:
                return rows, tokens, False
        kept: deque[Row] = deque()
        open_ = True  # no row of the pass stops short of its prompt's end yet
        while self.waiting:
            row = self.waiting.popleft()
            need = self._uncached(row) if open_ and len(self.running) < self.limits.max_batch_size else 0
            grant = self._grant(need, tokens) if need > 0 else 0
            if grant == 0:
                kept.append(row)
                continue
            error = self._load_adapter(row)
            if error is not None:
                row.done = True
                failed.append((row, error))
                continue
            if row.adapter is not None and not row.adapter.ready():
                kept.append(row)
                continue
            self._bind(row)
            rows.append(row)
            tokens.append(grant)
            self.running.append(row)
            open_ = grant >= need
        self.waiting = kept
        return rows, tokens, open_

    def _uncached(self, row: Row) -> int:
        """Prompt tokens a newcomer will compute: its prompt less the blocks the prefix cache holds for it now."""
        if self._cached is None:
            return row.remaining
        try:
            key = row.adapter.kv_key() if row.adapter is not None else None
        except LoraplexError:  # unregistered meanwhile: admission reports it
            return row.remaining
        return row.remaining - self._cached(row.request.prompt_ids, key)

    def _grant(self, remaining: int, granted: list[int]) -> int:
        """Prompt tokens the next row of a pass (``granted``: the tokens of the rows before it) may compute: all it
        has left while the padded pass fits the budget (with chunking off, the first row always); else, chunking
        on, the largest chunk that keeps the pass within it; else 0: not this step."""
        chunk = self.limits.prefill_chunk_tokens
        budget = chunk if chunk > 0 else self.limits.prefill_token_budget
        k, width = len(granted) + 1, max(granted, default=0)
        if k * max(width, remaining) <= budget or (chunk == 0 and not granted):
            return remaining
        part = budget // k
        return part if chunk > 0 and part >= max(width, 1) else 0

    @staticmethod
    def _load_adapter(row: Row) -> LoraplexError | None:
        """Ask for the row's adapter (non-blocking; loads run on the adapters' threads); its error, if any."""
        if row.adapter is None:
            return None
        try:
            row.adapter.load()
        except LoraplexError as exc:  # unregistered meanwhile, store closed
            return exc
        return row.adapter.failure()

    def _bind(self, row: Row) -> None:
        """Set what the runner reads for an admitted row: its ready adapter's binding (per-layer deltas, a drafter)
        and K/V key; a greedy row without an adapter drafter gets the server's drafter, if any."""
        drafter = self._drafter
        if row.adapter is not None:
            binding = row.adapter.binding()
            row.deltas = binding.deltas
            row.kv_key = row.adapter.kv_key()
            drafter = binding.drafter if binding.drafter is not None else drafter
        # Speculation serves greedy rows (output identical to plain greedy); sampled, penalized or logprob rows
        # decode one token per step, so their distribution and logprobs are exactly the plain ones.
        if row.request.speculate is not False and row.request.sampling.argmax_only:
            row.drafter = drafter

    def drafting(self, batch: int) -> bool:
        """Rows with a drafter draft for the next step of ``batch`` decoding rows? Not above
        ``speculate_max_batch``; below it, as the governor measures (asked only in steps where some row has one)."""
        if not any(r.drafter is not None for r in self.running):
            return False
        if batch > self.limits.speculate_max_batch:
            return False
        return not self.limits.speculate_adaptive or self.governor.choose(batch)

    def compact(self) -> None:
        """Drop finished rows: decoding rows fill slots ``0..d-1`` and prefilling rows ``d..n-1`` again, a row past
        its group's new end moving its cache into a hole (the last such row into the first hole)."""
        rows = self.running
        if not any(r.done for r in rows):
            return
        slots: list[Row | None] = [None if r.done else r for r in rows]
        live = [r for r in slots if r is not None]
        d = sum(1 for r in live if not r.prefilling)
        for lo, hi, prefilling in ((0, d, False), (d, len(live), True)):
            holes = [i for i in range(lo, hi) if slots[i] is None]
            for src in range(len(slots) - 1, hi - 1, -1):
                row = slots[src]
                if row is None or row.prefilling != prefilling:
                    continue
                dst = holes.pop(0)
                self._move(src, dst, row.length)
                slots[dst], slots[src] = row, None
        self.running = [r for r in slots[: len(live)] if r is not None]

    def drain(self) -> list[Row]:
        """Every row still queued or running (shutdown), leaving none."""
        rows = [*self.running, *self.waiting]
        self.running, self.waiting = [], deque()
        return rows


__all__ = ["PREFILL_TOKEN_BUDGET", "Scheduler", "SchedulerLimits", "StepPlan"]
