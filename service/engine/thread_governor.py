"""Intra-op threads per decode step: as many as pay, measured, so a busy neighbour cannot collapse throughput.

Public API::

    ThreadGovernor(max_threads, min_samples=4, probe_every=50, max_probe_every=800, margin=0.05, drop=0.5)
    governor.choose(key) -> int                    threads for the next decode step of this kind
    governor.record(key, threads, seconds, rows)   what that step took
    governor.hint(threads)                         start from this many (what other processes leave free)
    governor.current, governor.levels, governor.estimate(key, threads) -> rows/s | None
    ThreadControl(settings)                        the engine's side: budget, governor, torch's thread count

Every intra-op parallel region ends at a barrier that waits for its slowest thread. When another process takes
a core, the kernel deschedules one of our threads for a time slice now and then, and each of the hundreds of
regions of a decode step may wait a slice: steps get an order of magnitude slower, with no error. One thread
never waits for another. The governor measures instead of guessing: rows per second of decode steps, per kind
of step (``key``: batch-size bucket, speculative or not), at the current thread count (an EWMA), and decides
for the whole engine, since contention is a property of the machine, not of the batch:

* two steps in a row at the current count much slower than its estimate (< ``drop`` x) replace that estimate
  and make the next step a probe with fewer threads (a collapse is seen in two steps). One such step alone is an
  outlier (a client's burst at a request's start, a page fault, a timer): it is neither averaged in nor acted on,
  since at one row a served step meets one every few dozen steps, and acting on each swapped two threads for one
  at every request;
* every ``interval`` steps (``probe_every`` at first) one step runs at a neighbouring count on the ladder
  ``max, max/2, ..., 1`` (down from the top, up from the bottom, alternating in between), so that the end of
  contention is noticed too.
  A probe that loses doubles the interval (up to ``max_probe_every``): under lasting contention probes with
  more threads are the expensive ones, and on a quiet machine the probes with fewer threads are pure cost, so
  both get rare while they keep losing; a switch resets the interval. A periodic probe waits until the step's
  key has ``min_samples`` steps at the current count, and a probe step of a key without them gives no verdict:
  a batch size's first step runs cold (a fresh server's first request: ~20x slower), and against that alone one
  thread looked faster, so a fresh server served its first requests on one thread;
* a probe faster than the current count's estimate for the same key by ``margin`` switches to it; during the
  first ``min_samples`` steps after a switch, two steps in a row below the previous count's estimate switch
  back (one lucky probe costs two slow steps, not many; one outlier in the trial does not undo a good switch);
* when the engine starts work after being idle, ``ThreadControl`` counts the CPUs other processes kept busy
  in the last moments before (``OtherLoad``, a window restarted at every idle wait) and hints the governor to
  start from the threads the rest can hold, so a neighbour that arrived while the engine slept costs no slow
  step at all. A hint down is checked by a probe up ``min_samples`` steps later (one step costs little, a wrong
  guess kept for a whole probe interval costs a whole burst of traffic); a CPU counts as taken only when others
  kept it more than three quarters busy.

Outputs do not depend on the thread count beyond floating-point summation order.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Hashable
from dataclasses import dataclass

from service import metrics
from service.config import Settings
from service.cpu_budget import OtherLoad, read_cpu_budget
from service.torch_threads import set_threads

__all__ = ["ThreadControl", "ThreadGovernor", "step_key"]

log = logging.getLogger("loraplex.engine")
IDLE_SECONDS = 0.25  # a gap between decode steps this long is a restart: look at the other load first
SAMPLE_SECONDS = 0.1  # while busy, restart the other-load window at most this often
TAKEN = 0.25  # a CPU others keep busy more than 1 - TAKEN of the time is not free for us


def step_key(rows: int, speculative: bool) -> tuple[int, bool]:
    """Steps of one key cost about the same: batch sizes in power-of-two buckets, plain vs speculative."""
    return (rows - 1).bit_length(), speculative  # 1, 2, 3-4, 5-8, ..., 17-32, ...


@dataclass
class _Estimate:
    value: float = 0.0
    n: int = 0

    def add(self, rate: float, alpha: float) -> None:
        self.n += 1
        self.value += max(alpha, 1.0 / self.n) * (rate - self.value)  # a mean first, an EWMA after 1/alpha


class ThreadGovernor:
    def __init__(
        self,
        max_threads: int,
        min_samples: int = 4,
        probe_every: int = 50,
        max_probe_every: int = 800,
        margin: float = 0.05,
        drop: float = 0.5,
    ) -> None:
        if max_threads < 1 or min_samples < 1 or not 2 <= probe_every <= max_probe_every:
            raise ValueError("max_threads >= 1, min_samples >= 1 and 2 <= probe_every <= max_probe_every")
        if margin < 0 or not 0 < drop < 1:
            raise ValueError("margin >= 0 and 0 < drop < 1")
        levels = [max_threads]
        while levels[-1] > 1:
            levels.append(levels[-1] // 2)
        self.levels: tuple[int, ...] = tuple(levels)  # high to low
        self.min_samples = min_samples
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.interval = probe_every  # steps between periodic probes now
        self.margin = margin
        self.drop = drop
        self.alpha = 0.2
        self.current = max_threads
        self.switches = 0
        self._est: dict[tuple[Hashable, int], _Estimate] = {}
        self._probe: int | None = None  # the count the next step tries
        self._collapse = False  # the probe follows a collapse: compared with the replaced estimate
        self._since_probe = 0
        self._probes = 0
        self._previous: int | None = None  # the count before the last switch, during its trial
        self._trial = 0  # steps left in the trial
        self._slow = 0  # steps in a row far below the settled estimate at the current count
        self._losses = 0  # trial steps in a row below the previous count's estimate

    def estimate(self, key: Hashable, threads: int) -> float | None:
        e = self._est.get((key, threads))
        return None if e is None or e.n == 0 else e.value

    def choose(self, key: Hashable) -> int:
        return self.current if self._probe is None else self._probe

    def record(self, key: Hashable, threads: int, seconds: float, rows: int) -> None:
        if seconds <= 0 or rows <= 0:
            return
        rate = rows / seconds
        if threads == self._probe:
            self._probe = None
            held = self._est.get((key, self.current))
            self._est[(key, threads)] = _Estimate(rate, 1)  # what it did before contention changed is stale
            if held is None or (held.n < self.min_samples and not self._collapse):
                return  # a step of a key without a settled estimate here (its first steps run cold): no verdict
            if rate > held.value * (1 + self.margin):
                self._switch(threads)
            else:
                self.interval = min(2 * self.interval, self.max_probe_every)
            return
        if threads != self.current:
            return
        e = self._est.setdefault((key, threads), _Estimate())
        settled = e.value if e.n >= self.min_samples else None
        slow = settled is not None and rate < settled * self.drop
        self._slow = self._slow + 1 if slow else 0
        if self._slow == 1:
            return  # an outlier until the next step confirms it
        e.add(rate, self.alpha)
        if self._trial > 0:
            self._trial -= 1
            fallback = None if self._previous is None else self.estimate(key, self._previous)
            self._losses = self._losses + 1 if fallback is not None and rate < fallback else 0
            if self._losses >= 2:
                self._switch(self._previous)  # type: ignore[arg-type]
                return
        self._since_probe += 1
        if slow and self.current > 1:
            e.value, e.n = rate, 1  # the machine changed: what it did before says nothing now
            self._slow = 0
            self._probe, self._collapse = self._neighbour(down=True), True
        elif self._since_probe >= self.interval and e.n >= self.min_samples:  # against a settled estimate only
            self._since_probe = 0
            self._probes += 1
            self._probe, self._collapse = self._neighbour(down=self._probes % 2 == 1), False

    def hint(self, threads: int) -> None:
        """Continue at the largest level <= ``threads``. Not a measured switch: no trial, estimates and the probe
        interval kept, so probes that kept losing stay rare across idle spells. A hint down is a guess from a
        fraction of a second of other processes' CPU time (a client's burst looks like a neighbour), so it is
        checked: the step after ``min_samples`` steps at the hinted level probes the level above."""
        level = next((t for t in self.levels if t <= threads), self.levels[-1])
        if level != self.current:
            down = level < self.current
            self.current, self._probe, self._trial, self._since_probe, self._slow = level, None, 0, 0, 0
            if down:
                self._since_probe = max(0, self.interval - self.min_samples)
            self.switches += 1

    def _neighbour(self, down: bool) -> int | None:
        i = self.levels.index(self.current)
        if i == 0:
            down = True
        elif i == len(self.levels) - 1:
            down = False
        j = i + 1 if down else i - 1
        return self.levels[j] if 0 <= j < len(self.levels) else None

    def _switch(self, threads: int) -> None:
        self._previous, self.current = self.current, threads
        self._trial, self._losses, self._slow = self.min_samples, 0, 0
        self._since_probe = 0
        self.interval = self.probe_every
        self.switches += 1
        for (_, level), e in self._est.items():
            if level == threads:
                e.n = min(e.n, 1)  # stale: the next samples replace it quickly


class ThreadControl:
    """The engine's side: the thread budget (logged once), the governor, and ``torch.set_num_threads`` on the
    engine thread when the count changes. ``--threads`` sets the maximum; ``--no-adaptive-threads`` pins it."""

    def __init__(self, settings: Settings) -> None:
        budget = None if settings.threads > 0 else read_cpu_budget()
        self.max_threads = settings.threads if budget is None else budget.threads
        detail = (
            "source=--threads"
            if budget is None
            else f"source={budget.source!r} affinity={budget.affinity} cgroup_quota={budget.quota} "
            f"physical_cores={budget.physical_cores}"
        )
        log.info("event=threads threads=%d %s adaptive=%s", self.max_threads, detail, settings.adaptive_threads)
        adaptive = settings.adaptive_threads and self.max_threads > 1
        self.governor = ThreadGovernor(self.max_threads) if adaptive else None
        self.threads = self.max_threads  # what torch runs with on the engine thread now
        self.cpus = sorted(os.sched_getaffinity(0))
        self.others = OtherLoad(self.cpus) if self.governor is not None else None
        self._last_step = self._last_sample = 0.0

    def start(self) -> None:
        """On the engine thread, before its first forward pass (torch's thread count is per calling thread)."""
        set_threads(self.max_threads)
        metrics.ENGINE_THREADS_BUDGET.set(self.max_threads)
        metrics.ENGINE_THREADS.set(self.max_threads)
        if self.others is not None:
            self.others.sample()  # the baseline of the first restart's window

    def before_step(self, key: Hashable) -> int:
        if self.governor is not None:
            if self.others is not None and time.monotonic() - self._last_step > IDLE_SECONDS:
                self._resume()
            threads = self.governor.choose(key)
            if threads != self.threads:
                set_threads(threads)
                self.threads = threads
        return self.threads

    def after_step(self, key: Hashable, threads: int, seconds: float, rows: int) -> None:
        if self.governor is None:
            return
        self._last_step = now = time.monotonic()
        if self.others is not None and now - self._last_sample > SAMPLE_SECONDS:
            self._last_sample = now
            self.others.sample()  # the window a restart looks at begins about here
        before = self.governor.current
        self.governor.record(key, threads, seconds, rows)
        after = self.governor.current
        if after != before:
            metrics.ENGINE_THREADS.set(after)  # the chosen count, not a one-step probe
            log.info(
                "event=threads_switch from=%d to=%d rows=%d rows_per_s_before=%.1f rows_per_s_after=%.1f",
                before, after, rows, self.governor.estimate(key, before) or 0.0,
                self.governor.estimate(key, after) or 0.0,
            )  # fmt: skip

    def idle(self) -> None:
        """Called while the engine waits for work: restart the other-load window, so that the next restart sees
        what other processes do now, not what they did during the whole idle spell."""
        now = time.monotonic()
        if self.others is not None and now - self._last_sample > SAMPLE_SECONDS:
            self._last_sample = now
            self.others.sample()

    def _resume(self) -> None:
        """After an idle spell: start from the threads that the CPUs other processes leave free can hold."""
        if self.governor is None or self.others is None:
            return
        busy = self.others.sample()
        if busy is None:
            return
        free = len(self.cpus) - busy
        before = self.governor.current
        self.governor.hint(max(1, min(self.max_threads, math.floor(free + 1 - TAKEN))))
        if self.governor.current != before:
            metrics.ENGINE_THREADS.set(self.governor.current)
            log.info("event=threads_switch from=%d to=%d other_cpus_busy=%.2f", before, self.governor.current, busy)
