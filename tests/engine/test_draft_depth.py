"""How deep a speculative step verifies drafts (``service.engine.draft_depth``): from measured acceptance per
depth and measured step costs per batch size; greedy output stays plain greedy's at any depth."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engines import req, run, stepped_engine, tokens_of

from service import metrics
from service.engine.draft_depth import DraftDepth
from service.tokenizer import Tokenizer

# Timed on an EPYC Zen 4 (2 cores), the Q4_1 GGUF in float32: plain steps of 1 and 4 rows, verifications of
# 1 x 9 and 4 x 9 positions (seconds).
COSTS = ((1, 1, 0.0074, False), (1, 9, 0.0239, True), (4, 4, 0.0132, False), (4, 36, 0.0793, True))


class Drafter:
    """A drafter as the depth sees one: any object, kept weakly."""


def measured(depth: DraftDepth) -> DraftDepth:
    for rows, positions, seconds, speculative in COSTS:
        depth.step(rows, positions, seconds, speculative)
    return depth


def test_nothing_measured_verifies_the_whole_draft() -> None:
    depth, drafter = DraftDepth(min_samples=2), Drafter()
    assert depth.limit(drafter, 1) is None  # no costs, no acceptance
    depth.walked(drafter, 8, 3)
    depth.walked(drafter, 8, 3)
    assert depth.limit(drafter, 1) is None  # acceptance, but no costs yet
    measured(depth)
    assert depth.limit(drafter, 1) == 3 and depth.limit(Drafter(), 1) is None  # another drafter: not measured
    assert depth.limit(drafter, 2) is None  # no costs measured at 2 rows


def test_the_cost_ratio_per_batch_size_sets_the_depth() -> None:
    """Half the walks accept the whole draft of 8, half nothing: each depth's token comes with a chance of ~0.5.
    At one row a further position costs 0.28 of a plain token (2.06 ms against 7.4): all 8 are worth it; at four
    rows 0.63 (2.07 ms against 3.3): none is, and the step verifies one token a row, the least."""
    depth, drafter = measured(DraftDepth(min_samples=4, probe_every=1000)), Drafter()
    for i in range(40):
        depth.walked(drafter, 8, 8 if i % 2 else 0)
    ratios = depth.thresholds()
    assert ratios[1] == pytest.approx((0.0239 - 0.0074) / 8 / 0.0074) and 0.27 < ratios[1] < 0.29
    assert ratios[4] == pytest.approx((0.0793 - 0.0132) / 32 * 4 / 0.0132) and 0.62 < ratios[4] < 0.63
    assert depth.limit(drafter, 1) is None
    assert depth.limit(drafter, 4) == 1
    sure = Drafter()  # drafts whose first 3 tokens are always right and the 4th never
    for _ in range(8):
        depth.walked(sure, 8, 3)
    assert depth.limit(sure, 1) == depth.limit(sure, 4) == 3


def test_the_walks_count_only_the_depths_they_reached() -> None:
    """A walk that rejects its first token says nothing about the second: depth 2's share stays that of the walks
    that reached it."""
    depth, drafter = measured(DraftDepth(min_samples=1, alpha=1.0, probe_every=1000)), Drafter()
    depth.walked(drafter, 8, 8)  # every depth reached and accepted
    depth.walked(drafter, 8, 0)  # depth 1 rejected (alpha 1: its share is now 0), depths 2.. not reached
    assert depth.limit(drafter, 1) == 1  # depth 1's chance is 0: the least, one token
    depth.walked(drafter, 8, 8)
    assert depth.limit(drafter, 4) is None  # every depth's share 1 again: the whole draft
    depth.walked(drafter, 3, 3)  # a draft of 3 accepted whole: depths 1-3 reached, 4.. not
    assert depth.limit(drafter, 4) is None


def test_every_probe_step_verifies_the_whole_draft() -> None:
    depth, drafter = measured(DraftDepth(min_samples=1, probe_every=4)), Drafter()
    depth.walked(drafter, 8, 1)
    limits = []
    for _ in range(8):
        limits.append(depth.limit(drafter, 1))
        depth.step(1, 1, 0.0074, False)
    assert limits.count(None) == 2 and set(limits) == {None, 1}  # deeper depths stay measured


def test_a_dropped_drafter_is_forgotten() -> None:
    depth, drafter = measured(DraftDepth(min_samples=1)), Drafter()
    depth.walked(drafter, 4, 4)
    assert len(depth._accept) == 1
    del drafter
    assert len(depth._accept) == 0  # an unloaded adapter's heads leave nothing behind


def test_settings_that_cannot_work_are_refused() -> None:
    for kwargs in ({"alpha": 0}, {"alpha": 1.5}, {"min_samples": 0}, {"probe_every": 1}):
        with pytest.raises(ValueError):
            DraftDepth(**kwargs)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_depth_of_one_keeps_plain_greedy_output_on_smollm2(smollm2_dir: Path) -> None:
    """Costs that make every further position too dear: after the first walk each verification checks one token a
    row, and the output is plain greedy's token for token."""
    from tests.engine.test_prompt_lookup import DRAFT, REPEAT

    tok = Tokenizer.from_folder(smollm2_dir)
    ids = tok.encode_chat([{"role": "user", "content": REPEAT}])
    plain = stepped_engine(smollm2_dir, max_batch_size=4)
    drafting = stepped_engine(smollm2_dir, **{**DRAFT, "max_batch_size": 4})
    depth = drafting.runner.depth = DraftDepth(min_samples=1, probe_every=10**6)
    depth.step(1, 1, 0.001, False)
    depth.step(1, 2, 1.0, True)  # a further position costs 1000 plain steps
    expected = tokens_of(run(plain, req("plain", ids, n=64))["plain"])
    drafted0, accepted0 = metrics.SPECULATIVE_DRAFTED._value.get(), metrics.SPECULATIVE_ACCEPTED._value.get()
    steps0 = metrics.SPECULATIVE_STEPS._value.get()
    assert tokens_of(run(drafting, req("drafted", ids, n=64))["drafted"]) == expected
    drafted = metrics.SPECULATIVE_DRAFTED._value.get() - drafted0
    steps = metrics.SPECULATIVE_STEPS._value.get() - steps0
    assert steps > 10 and drafted <= 8 + (steps - 1)  # the first walk whole, then one token a row
    assert metrics.SPECULATIVE_ACCEPTED._value.get() - accepted0 > 0
