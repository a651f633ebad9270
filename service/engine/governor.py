"""When speculative decoding pays: measured, per batch size, instead of guessed.

Public API::

    SpeculationGovernor(min_samples=4, probe_every=64, max_probe_every=1024, alpha=0.2, margin=0.2,
                        probe_budget=0.03)
    governor.choose(batch) -> bool                 speculate in the next decode step of a batch this size?
    governor.record(batch, speculative, seconds, tokens)
    governor.rates(batch) -> (plain tok/s | None, speculative tok/s | None)
    governor.probe_interval(batch) -> int          steps between two probes of the losing kind, now

Whether verifying drafts is faster than one token per step depends on the hardware, the dtype, the drafter and the
text: on a GPU a 4-position verification costs about one plain step; on a 2-core CPU in float32 small-M matrix
products are relatively slow, so a verification step costs 1.5-2x a plain one and heads that gain 1.2-1.4 tokens
per step lose, while prompt lookup on text that copies its prompt gains 2-3x. A fixed batch-size switch
(``--speculate-max-batch``) cannot know that. The governor measures instead: output tokens per second of decode
steps of each kind, per batch size, as exponential moving averages, and keeps the faster kind.

Measuring costs steps of the losing kind, so it is kept small:

- a batch size first takes ``min_samples`` speculative steps, then as many plain ones, unless a *neighbour* has
  decided already: a verification's extra positions cost more the more rows a step has, so a size where
  speculation lost says it loses at every larger size, and a size where it won says it wins at every smaller one.
  A size with such a neighbour starts with the neighbour's choice and measures the other kind by probes only;
- once decided, one step in ``probe_every`` probes the other kind, so that a change (longer contexts, other rows,
  other heads, text that starts or stops copying its prompt) is noticed. While speculating, each plain probe that
  confirms the choice by more than ``margin`` doubles the interval, up to ``max_probe_every`` (a change of choice
  brings it back to ``probe_every``); while decoding plainly the interval stays: a drafter's worth can change
  within one answer (prompt lookup pays only where the text copies), and a late switch to speculation loses more
  than a probe costs;
- a probe faster than the chosen kind's average starts a trial: ``min_samples`` steps of the probed kind, so one
  probe's news moves its average far enough to change the choice where it should (a single sample moves it by
  ``alpha`` only, and the next probe is ``probe_every`` steps away). A trial that keeps the choice doubles the
  interval (up to ``max_probe_every``): its probe was luck (Medusa heads that gain 1.2 tokens a step accept a long
  draft now and then), and each such trial costs ``min_samples`` slow steps;
- a probe's cost bounds how often it comes: one step of the losing kind loses ``t_l (1 - r_l / r_c)`` seconds
  (its duration, less the time the chosen kind takes for the same tokens), and probes come at least that loss over
  ``probe_budget`` times the chosen kind's step apart (up to ``max_probe_every``), so they take at most about
  ``probe_budget`` of the decode time. It matters where the kinds' steps differ most: a verification of 4 rows x 9
  positions on a 2-core CPU takes 6x a plain 4-row step, and one such probe every 64 steps cost ~8 %.

Greedy output is the same either way; only speed depends on the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def ewma(old: float | None, new: float, alpha: float) -> float:
    """An exponential moving average's next value: ``new`` first, then ``alpha`` of the way from ``old`` to it."""
    return new if old is None else old + alpha * (new - old)


@dataclass
class _Rates:
    plain: float | None = None  # EWMA output tokens / s of plain decode steps
    spec: float | None = None
    plain_n: int = 0
    spec_n: int = 0
    since_probe: int = 0
    interval: int = 0  # steps between probes now (0: not set yet, probe_every)
    trial: int = 0  # steps of ``trial_kind`` still to take after a surprising probe
    trial_kind: bool = False
    trial_from: bool | None = None  # the choice when the running trial began
    plain_s: float | None = None  # EWMA seconds of a plain decode step
    spec_s: float | None = None


class SpeculationGovernor:
    def __init__(
        self,
        min_samples: int = 4,
        probe_every: int = 64,
        max_probe_every: int = 1024,
        alpha: float = 0.2,
        margin: float = 0.2,
        probe_budget: float = 0.03,
    ) -> None:
        if min_samples < 1 or probe_every < 2 or max_probe_every < probe_every or not 0 < alpha <= 1:
            raise ValueError("min_samples >= 1, 2 <= probe_every <= max_probe_every and 0 < alpha <= 1 are required")
        if not 0 <= margin < 1:
            raise ValueError("0 <= margin < 1 is required")
        if not 0 < probe_budget <= 1:
            raise ValueError("0 < probe_budget <= 1 is required")
        self.min_samples = min_samples
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.alpha = alpha
        self.margin = margin
        self.probe_budget = probe_budget
        self._by_batch: dict[int, _Rates] = {}

    def _rates(self, batch: int) -> _Rates:
        r = self._by_batch.get(batch)
        if r is None:
            r = self._by_batch[batch] = _Rates(interval=self.probe_every)
        return r

    def _measured(self, r: _Rates) -> bool:
        return r.spec_n >= self.min_samples and r.plain_n >= self.min_samples

    def _decided(self, batch: int) -> bool | None:
        """This size's choice (True: speculate) from its own measurements, else from a neighbour's, else None."""
        r = self._by_batch.get(batch)
        if r is not None and self._measured(r):
            assert r.plain is not None and r.spec is not None
            return r.spec >= r.plain
        lost_below = won_above = False
        for b, other in self._by_batch.items():
            if b == batch or not self._measured(other):
                continue
            assert other.plain is not None and other.spec is not None
            wins = other.spec >= other.plain
            lost_below |= b < batch and not wins
            won_above |= b > batch and wins
        if lost_below == won_above:  # no neighbour, or neighbours that disagree: measure this size
            return None
        return won_above

    def choose(self, batch: int) -> bool:
        r = self._rates(batch)
        if r.trial > 0:
            r.trial -= 1
            return r.trial_kind
        better = self._decided(batch)
        if better is None:
            return r.spec_n < self.min_samples  # speculative steps first, then plain ones
        r.since_probe += 1
        if r.since_probe >= self._spacing(r, better):
            r.since_probe = 0
            return not better
        return better

    def record(self, batch: int, speculative: bool, seconds: float, tokens: int) -> None:
        if seconds <= 0:
            return
        r = self._rates(batch)
        before = self._decided(batch)
        rate = tokens / seconds
        if speculative:
            r.spec, r.spec_s = ewma(r.spec, rate, self.alpha), ewma(r.spec_s, seconds, self.alpha)
            r.spec_n += 1
        else:
            r.plain, r.plain_s = ewma(r.plain, rate, self.alpha), ewma(r.plain_s, seconds, self.alpha)
            r.plain_n += 1
        after = self._decided(batch)
        if before is None or after is None or r.plain is None or r.spec is None:
            return
        chosen = r.spec if before else r.plain
        if r.trial_from is not None and r.trial == 0:  # the trial's last step
            if after == r.trial_from:  # it kept the choice: the probe was luck (a long accepted draft), probe rarer
                r.interval = min(2 * r.interval, self.max_probe_every)
            r.trial_from = None
        elif speculative != before and r.trial == 0 and rate > chosen:  # a probe beat the choice: try that kind
            r.trial, r.trial_kind, r.trial_from = self.min_samples, speculative, before
        if after != before:
            r.interval, r.since_probe = self.probe_every, 0
        elif after and not speculative and r.plain < (1 - self.margin) * r.spec:
            r.interval = min(2 * r.interval, self.max_probe_every)  # a plain probe confirmed speculation, clearly

    def _spacing(self, r: _Rates, better: bool) -> int:
        """Steps between two probes now: the interval, or more where a probe of the losing kind costs more than
        ``probe_budget`` of the steps between probes."""
        chosen, chosen_s = (r.spec, r.spec_s) if better else (r.plain, r.plain_s)
        probe, probe_s = (r.plain, r.plain_s) if better else (r.spec, r.spec_s)
        if chosen is None or chosen_s is None or probe is None or probe_s is None or chosen <= 0 or chosen_s <= 0:
            return r.interval  # a neighbour's choice, this size not measured yet
        loss = probe_s * max(0.0, 1 - probe / chosen)  # seconds a probe loses against the chosen kind
        return max(r.interval, min(self.max_probe_every, math.ceil(loss / (self.probe_budget * chosen_s))))

    def rates(self, batch: int) -> tuple[float | None, float | None]:
        r = self._by_batch.get(batch, _Rates())
        return r.plain, r.spec

    def probe_interval(self, batch: int) -> int:
        """Steps between two probes of the losing kind at this size now (its interval, spaced by the probe's cost)."""
        r = self._rates(batch)
        better = self._decided(batch)
        return r.interval if better is None else self._spacing(r, better)


__all__ = ["SpeculationGovernor", "ewma"]
