"""When speculative decoding pays: measured, per batch size, instead of guessed.

Public API::

    SpeculationGovernor(min_samples=8, probe_every=64, alpha=0.2)
    governor.choose(batch) -> bool                 speculate in the next decode step of a batch this size?
    governor.record(batch, speculative, seconds, tokens)
    governor.rates(batch) -> (plain tok/s | None, speculative tok/s | None)

Whether verifying drafts is faster than one token per step depends on the hardware, the dtype and the heads: on
a GPU a 4-position verification costs about one plain step; on a 2-core CPU in float32 small-M matrix products
are relatively slow, so a verification step costs 1.5-2x a plain one and heads that gain 1.2-1.4 tokens per step
lose. A fixed batch-size switch (``--speculate-max-batch``) cannot know that. The governor measures instead:
output tokens per second of decode steps of each kind, per batch size, as exponential moving averages. It first
takes ``min_samples`` steps of each kind, then picks the faster, and every ``probe_every`` steps takes one step of
the other kind so that a change (longer contexts, other heads, other rows) is noticed. Greedy output is the same
either way; only speed depends on the choice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Rates:
    plain: float | None = None  # EWMA output tokens / s of plain decode steps
    spec: float | None = None
    plain_n: int = 0
    spec_n: int = 0
    since_probe: int = 0


class SpeculationGovernor:
    def __init__(self, min_samples: int = 8, probe_every: int = 64, alpha: float = 0.2) -> None:
        if min_samples < 1 or probe_every < 2 or not 0 < alpha <= 1:
            raise ValueError("min_samples >= 1, probe_every >= 2 and 0 < alpha <= 1 are required")
        self.min_samples = min_samples
        self.probe_every = probe_every
        self.alpha = alpha
        self._by_batch: dict[int, _Rates] = {}

    def choose(self, batch: int) -> bool:
        r = self._by_batch.setdefault(batch, _Rates())
        if r.spec_n < self.min_samples:
            return True
        if r.plain_n < self.min_samples:
            return False
        assert r.plain is not None and r.spec is not None
        better = r.spec >= r.plain
        r.since_probe += 1
        if r.since_probe >= self.probe_every:
            r.since_probe = 0
            return not better
        return better

    def record(self, batch: int, speculative: bool, seconds: float, tokens: int) -> None:
        if seconds <= 0:
            return
        r = self._by_batch.setdefault(batch, _Rates())
        rate = tokens / seconds
        if speculative:
            r.spec = rate if r.spec is None else r.spec + self.alpha * (rate - r.spec)
            r.spec_n += 1
        else:
            r.plain = rate if r.plain is None else r.plain + self.alpha * (rate - r.plain)
            r.plain_n += 1

    def rates(self, batch: int) -> tuple[float | None, float | None]:
        r = self._by_batch.get(batch, _Rates())
        return r.plain, r.spec
