"""How deep a speculative step verifies drafts, per batch size: from measured acceptance and measured step costs.

Public API::

    DraftDepth(alpha=0.05, min_samples=8, probe_every=16)
    depth.limit(drafter, rows) -> int | None       deepest drafted token to verify in a step of ``rows`` rows
    depth.walked(drafter, verified, accepted)      a row's walk: drafted depth verified, tokens accepted
    depth.step(rows, positions, seconds, speculative)   a decode step's cost
    depth.thresholds() -> {rows: chance}            per batch size measured, the chance a drafted token needs

A verification pass feeds every row its pending token and its draft: ``rows x width`` positions. Past a few
positions a CPU pass is compute-bound, so each further position costs about the same, whatever row it belongs to
(EPYC Zen 4, 2 cores, the Q4_1 GGUF in float32, the runner's two decode kinds timed in one process: a plain step
10.5 ms at 1 row and 15.5 ms at 4; a verification of 1 x 9 positions 26.0 ms and 4 x 9 70.8 ms: ~1.7-1.9 ms a
position). A drafted token at depth *i* pays where the chance that the walk reaches and accepts it is larger than
that cost over a plain step's cost per token: ~0.2 at one row (10.5 ms a token), ~0.45 at four (3.9 ms). So drafts
that gain 2x at batch 1 gain far less at batch 4, and lose where they are seldom accepted; Medusa's
``--draft-threshold`` asks the heads for the first chance, this measures it.

- **Acceptance**, per drafter: for each depth *i*, the share of walks that reached depth *i* and accepted its token
  (an exponential moving average, ``alpha``); their product up to *i* is the chance of emitting token *i*.
- **Cost**, per batch size: the plain step's seconds, and a verification's seconds beyond it per further position.
- **Limit**: the deepest *i* whose chance is at least the cost ratio (at least 1: whether to speculate at all is
  the speculation governor's question); ``None`` (the draft as proposed) until the depths and costs are measured,
  and every ``probe_every``-th step, which verifies full drafts so that deeper depths stay measured when the text
  starts (or stops) copying.

The engine asks only with ``--speculate-adaptive`` (the default); a verified draft's output is plain greedy's at
any depth, so only speed depends on it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from service.engine.governor import ewma


@dataclass
class _Acceptance:
    rates: list[float] = field(default_factory=list)  # rates[i]: EWMA share of walks reaching depth i + 1 that accept
    counts: list[int] = field(default_factory=list)


class DraftDepth:
    def __init__(self, alpha: float = 0.05, min_samples: int = 8, probe_every: int = 16) -> None:
        if not 0 < alpha <= 1 or min_samples < 1 or probe_every < 2:
            raise ValueError("0 < alpha <= 1, min_samples >= 1 and probe_every >= 2 are required")
        self.alpha, self.min_samples, self.probe_every = alpha, min_samples, probe_every
        self._accept: weakref.WeakKeyDictionary[object, _Acceptance] = weakref.WeakKeyDictionary()
        self._plain_s: dict[int, float] = {}  # rows -> EWMA seconds of a plain step
        self._position_s: dict[int, float] = {}  # rows -> EWMA seconds of a verification's further position
        self._steps = 0

    def step(self, rows: int, positions: int, seconds: float, speculative: bool) -> None:
        self._steps += 1
        if not speculative:
            self._plain_s[rows] = ewma(self._plain_s.get(rows), seconds, self.alpha)
            return
        plain = self._plain_s.get(rows)
        if plain is not None and positions > rows:
            further = max(0.0, seconds - plain) / (positions - rows)
            self._position_s[rows] = ewma(self._position_s.get(rows), further, self.alpha)

    def walked(self, drafter: object, verified: int, accepted: int) -> None:
        """A row verified its draft to depth ``verified`` and accepted its first ``accepted`` tokens."""
        acc = self._accept.get(drafter)
        if acc is None:
            acc = self._accept[drafter] = _Acceptance()
        for i in range(min(accepted + 1, verified)):  # the depths the walk reached
            if i == len(acc.rates):
                acc.rates.append(float(i < accepted))
                acc.counts.append(1)
                continue
            acc.rates[i] = ewma(acc.rates[i], float(i < accepted), self.alpha)
            acc.counts[i] += 1

    def limit(self, drafter: object, rows: int) -> int | None:
        """The deepest drafted token worth verifying in a step of ``rows`` rows; None: the whole draft."""
        plain, further, acc = self._plain_s.get(rows), self._position_s.get(rows), self._accept.get(drafter)
        if plain is None or further is None or acc is None or self._steps % self.probe_every == 0:
            return None
        threshold = further * rows / plain  # a position's cost over a plain step's cost per token
        chance = 1.0
        for i, (rate, n) in enumerate(zip(acc.rates, acc.counts, strict=True)):
            if n < self.min_samples:
                return None  # not measured this deep yet: the whole draft
            chance *= rate
            if chance < threshold:
                return max(1, i)
        return None

    def thresholds(self) -> dict[int, float]:
        """Per batch size measured: the chance a drafted token needs to be worth its position."""
        return {r: self._position_s[r] * r / self._plain_s[r] for r in sorted(self._position_s) if r in self._plain_s}


__all__ = ["DraftDepth"]
