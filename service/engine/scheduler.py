"""The scheduler: pure policy over request state, deciding what each engine step does.

Each step it retires cancelled and expired rows, admits waiting rows into free KV slots in arrival order (under
the batch size, the prefill token budget and adapter readiness; a row whose adapter is still loading never holds
up rows behind it) and says whether rows with Medusa heads draft for the next step (the speculation governor
decides). It returns a ``StepPlan``; the runner executes it and the output processor delivers the results.

Invariant: running rows are compacted in KV slots ``0..n-1`` (row ``i`` lives in slot ``i``); when a row retires
the last live row moves into the hole through the injected ``move(src, dst, length)`` (the KV cache's). The
scheduler imports no torch and never touches tensors, so tests step it with fake rows and adapters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from service.engine.governor import SpeculationGovernor
from service.engine.request import FinishReason
from service.engine.row import Row
from service.errors import LoraplexError

# Padded prompt tokens one prefill pass may hold: bounds the prefill's activation memory and the time running
# streams wait while newcomers are prefilled.
PREFILL_TOKEN_BUDGET = 8192

Move = Callable[[int, int, int], None]  # (src_slot, dst_slot, length): the KV cache's slot move


@dataclass(frozen=True)
class StepPlan:
    """What one step does. Retired and failed rows have left the running set and the waiting queue already."""

    retired: tuple[tuple[Row, FinishReason], ...]  # cancelled / past their deadline
    failed: tuple[tuple[Row, LoraplexError], ...]  # their adapter cannot load
    prefill: tuple[Row, ...]  # newcomers, in slots ``prefill_start ..``, running from this step on
    prefill_start: int
    draft: bool  # rows with heads draft for the next step


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int
    speculate_max_batch: int
    speculate_adaptive: bool
    prefill_token_budget: int = PREFILL_TOKEN_BUDGET


class Scheduler:
    def __init__(self, limits: SchedulerLimits, move: Move, governor: SpeculationGovernor | None = None) -> None:
        self.limits = limits
        self.governor = governor if governor is not None else SpeculationGovernor()
        self._move = move
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []

    def add(self, row: Row) -> None:
        self.waiting.append(row)

    def schedule(self, now: float) -> StepPlan:
        retired = self._retire(now)
        self.compact()
        failed: list[tuple[Row, LoraplexError]] = []
        start = len(self.running)
        admitted = self._admit(failed)
        return StepPlan(tuple(retired), tuple(failed), tuple(admitted), start, self.drafting())

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

    def _admit(self, failed: list[tuple[Row, LoraplexError]]) -> list[Row]:
        """Move waiting rows into free slots, in arrival order, skipping rows whose adapter is not ready."""
        admitted: list[Row] = []
        longest = 0
        kept: deque[Row] = deque()
        budget = self.limits.prefill_token_budget
        while self.waiting:
            row = self.waiting.popleft()
            n = len(row.request.prompt_ids)
            full = len(self.running) >= self.limits.max_batch_size
            over_budget = bool(admitted) and max(longest, n) * (len(admitted) + 1) > budget
            if full or over_budget:
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
            self._bind_adapter(row)
            longest = max(longest, n)
            admitted.append(row)
            self.running.append(row)
        self.waiting = kept
        return admitted

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

    @staticmethod
    def _bind_adapter(row: Row) -> None:
        """Set what the runner reads from a ready adapter: its LoRA part, K/V key and (greedy rows) heads."""
        adapter = row.adapter
        if adapter is None:
            return
        row.lora = adapter.has_lora
        row.kv_key = adapter.kv_key()
        sampling = row.request.sampling
        # Speculation serves greedy rows (output identical to plain greedy); sampled, penalized or logprob rows
        # decode one token per step, so their distribution and logprobs are exactly the plain ones.
        plain_greedy = sampling.greedy and not sampling.penalized and not sampling.logprobs
        if adapter.has_heads and row.request.speculate is not False and plain_greedy:
            row.heads = adapter.heads()

    def drafting(self) -> bool:
        """Rows with heads draft for the next step? Not above ``speculate_max_batch``; below it, as the governor
        measures (asked only in steps where some row has heads)."""
        if not any(r.heads is not None for r in self.running):
            return False
        batch = len(self.running)
        if batch > self.limits.speculate_max_batch:
            return False
        return not self.limits.speculate_adaptive or self.governor.choose(batch)

    def compact(self) -> None:
        """Drop finished rows, moving the last live row's cache into each hole (row i stays in slot i)."""
        rows = self.running
        i = 0
        while i < len(rows):
            if not rows[i].done:
                i += 1
                continue
            while len(rows) - 1 > i and rows[-1].done:
                rows.pop()
            last = len(rows) - 1
            if last != i:
                self._move(last, i, rows[last].length)
                rows[i] = rows[last]
            rows.pop()

    def drain(self) -> list[Row]:
        """Every row still queued or running (shutdown), leaving none."""
        rows = [*self.running, *self.waiting]
        self.running, self.waiting = [], deque()
        return rows


__all__ = ["PREFILL_TOKEN_BUDGET", "Scheduler", "SchedulerLimits", "StepPlan"]
