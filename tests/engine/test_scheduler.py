"""The scheduler stepped by hand over fake request state: no model, no torch tensors, no threads."""

from __future__ import annotations

from typing import cast

from service.adapters.common.part import Binding
from service.adapters.handle import Adapter
from service.drafters.base import Drafter
from service.engine.detok import IncrementalDetokenizer
from service.engine.governor import SpeculationGovernor
from service.engine.request import FinishReason, GenerationRequest, RequestHandle
from service.engine.row import Row
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler, SchedulerLimits, StepPlan
from service.errors import CheckpointError, LoraplexError


class FakeAdapter:
    """What the scheduler asks of an adapter: load (command), ready / failure / kv_key / binding (queries)."""

    def __init__(self, ready_after: int = 0, error: LoraplexError | None = None, heads: object = None) -> None:
        self.id = "fake"
        self.loads = 0
        self._ready_after = ready_after
        self._error = error
        self._heads = heads

    def load(self) -> None:
        self.loads += 1

    def ready(self) -> bool:
        return self.loads > self._ready_after

    def failure(self) -> LoraplexError | None:
        return self._error

    def kv_key(self) -> tuple[str, float]:
        return (self.id, 1.0)

    def binding(self) -> Binding:
        return Binding(deltas=True, drafter=cast(Drafter, self._heads))


def row(rid: str, n: int = 4, adapter: FakeAdapter | None = None, **kw: object) -> Row:
    request = GenerationRequest(request_id=rid, prompt_ids=tuple(range(1, n + 1)), max_new_tokens=8, **kw)  # type: ignore[arg-type]
    return Row(
        handle=RequestHandle(request),
        sink=lambda e: None,
        detok=cast(IncrementalDetokenizer, None),
        stops=None,
        generator=None,
        ids=list(request.prompt_ids),
        adapter=cast(Adapter, adapter),
    )


def scheduler(
    batch: int = 4, budget: int = 8192, spec_batch: int = 8, adaptive: bool = False, chunk: int = 0
) -> tuple[Scheduler, list]:
    moves: list[tuple[int, int, int]] = []
    limits = SchedulerLimits(batch, spec_batch, adaptive, prefill_token_budget=budget, prefill_chunk_tokens=chunk)
    return Scheduler(limits, lambda s, d, n: moves.append((s, d, n))), moves


def step(s: Scheduler, now: float = 0.0) -> StepPlan:
    """Plan a step and do what the runner does to the rows' state: each row of the pass computes its tokens."""
    plan = s.schedule(now)
    for r, n in zip(plan.prefill, plan.prefill_tokens, strict=True):
        r.length = min(r.length + n, len(r.request.prompt_ids))
    return plan


def passes(s: Scheduler, steps: int) -> list[tuple[int, list[tuple[str, int]]]]:
    """(prefill_start, [(request id, tokens)]) of each of the next ``steps`` steps."""
    out = []
    for _ in range(steps):
        plan = step(s)
        pairs = zip(plan.prefill, plan.prefill_tokens, strict=True)
        out.append((plan.prefill_start, [(r.request.request_id, n) for r, n in pairs]))
    return out


def ids(rows: object) -> list[str]:
    return [r.request.request_id for r in rows]  # type: ignore[attr-defined]


def test_admits_in_arrival_order_up_to_the_batch_size() -> None:
    s, _ = scheduler(batch=2)
    for name in "abc":
        s.add(row(name))
    plan = step(s)
    assert ids(plan.prefill) == ["a", "b"] and plan.prefill_start == 0
    assert ids(s.running) == ["a", "b"] and ids(s.waiting) == ["c"]
    assert step(s).prefill == ()  # full: c waits
    s.running[0].done = True
    plan = step(s)
    assert ids(plan.prefill) == ["c"] and plan.prefill_start == 1


def test_prefill_token_budget_splits_a_burst() -> None:
    s, _ = scheduler(batch=8, budget=20)
    for name in "abcd":
        s.add(row(name, n=8))
    assert ids(step(s).prefill) == ["a", "b"]  # 3 * 8 padded tokens > 20
    assert ids(step(s).prefill) == ["c", "d"]


def test_retires_cancelled_and_expired_rows_and_compacts_their_slots() -> None:
    s, moves = scheduler()
    for name in "abcd":
        s.add(row(name, deadline=5.0 if name == "b" else None))
    s.schedule(0.0)
    for r in s.running:
        r.length = 10 + len(r.request.request_id)
    s.running[0].handle.cancel()
    plan = s.schedule(6.0)
    assert [(r.request.request_id, why) for r, why in plan.retired] == [
        ("a", FinishReason.CANCELLED),
        ("b", FinishReason.DEADLINE),
    ]
    assert all(r.done for r, _ in plan.retired)
    assert ids(s.running) == ["d", "c"]  # the last live row moved into each hole
    assert moves == [(3, 0, 11), (2, 1, 11)]


def test_a_loading_adapter_does_not_hold_up_rows_behind_it() -> None:
    s, _ = scheduler()
    slow = FakeAdapter(ready_after=2)
    s.add(row("cold", adapter=slow))
    s.add(row("base"))
    assert ids(step(s).prefill) == ["base"]
    assert ids(s.waiting) == ["cold"] and slow.loads == 1
    assert step(s).prefill == ()
    plan = step(s)
    assert ids(plan.prefill) == ["cold"] and slow.loads == 3
    admitted = plan.prefill[0]
    assert admitted.deltas and admitted.kv_key == ("fake", 1.0) and admitted.drafter is None


def test_a_failed_adapter_fails_its_row_only() -> None:
    s, _ = scheduler()
    error = CheckpointError("bad tensor")
    s.add(row("broken", adapter=FakeAdapter(error=error)))
    s.add(row("ok"))
    plan = s.schedule(0.0)
    assert [(r.request.request_id, e) for r, e in plan.failed] == [("broken", error)]
    assert ids(plan.prefill) == ["ok"] and not s.waiting


def test_heads_draft_for_plain_greedy_rows_only_and_the_governor_decides() -> None:
    heads = object()
    s, _ = scheduler(spec_batch=2)
    s.add(row("greedy", adapter=FakeAdapter(heads=heads)))
    s.add(row("sampled", adapter=FakeAdapter(heads=heads), sampling=SamplingParams(temperature=0.8)))
    s.add(row("off", adapter=FakeAdapter(heads=heads), speculate=False))
    plan = step(s)
    assert [r.drafter is heads for r in plan.prefill] == [True, False, False]
    assert not plan.draft  # 3 rows decode this step > speculate_max_batch=2
    s.running[2].done = True
    assert step(s).draft

    adaptive, _ = scheduler(adaptive=True)
    adaptive.governor = SpeculationGovernor(min_samples=1, probe_every=4)
    adaptive.add(row("greedy", adapter=FakeAdapter(heads=heads)))
    assert adaptive.schedule(0.0).draft  # measuring the speculative kind first
    adaptive.governor.record(1, True, 1.0, 1)
    adaptive.governor.record(1, False, 1.0, 5)
    assert not adaptive.schedule(0.0).draft  # plain steps measured faster


def test_no_heads_no_governor_question() -> None:
    s, _ = scheduler(adaptive=True)
    s.add(row("a"))
    assert not s.schedule(0.0).draft
    assert s.governor.rates(1) == (None, None)


def test_drain_leaves_nothing() -> None:
    s, _ = scheduler(batch=1)
    s.add(row("a"))
    s.add(row("b"))
    s.schedule(0.0)
    assert ids(s.drain()) == ["a", "b"] and not s.running and not s.waiting


def test_chunking_off_prefills_whole_prompts_the_first_row_whatever_its_length() -> None:
    s, _ = scheduler(batch=8, budget=20)
    s.add(row("long", n=30))
    s.add(row("short", n=4))
    assert passes(s, 2) == [(0, [("long", 30)]), (1, [("short", 4)])]  # 2 * 30 > 20: short waits a step


def test_a_long_prompt_is_prefilled_in_chunks_while_the_running_rows_decode() -> None:
    s, _ = scheduler(batch=8, chunk=8)
    s.add(row("a", n=4))
    assert passes(s, 1) == [(0, [("a", 4)])]
    s.add(row("long", n=30))
    assert passes(s, 2) == [(1, [("long", 8)]), (1, [("long", 8)])]
    assert s.decoding == 1 and ids(s.running) == ["a", "long"] and s.running[1].length == 16
    s.add(row("b", n=4))  # arrives mid-prefill: no newcomer runs ahead of the row part-way through its prompt
    assert passes(s, 1) == [(1, [("long", 8)])] and ids(s.waiting) == ["b"]
    # long's last 6 tokens: 2 rows x max(6, 4) > 8 and 8 // 2 < 6, so b waits for the next pass
    assert passes(s, 2) == [(1, [("long", 6)]), (2, [("b", 4)])]
    assert s.decoding == 3 and ids(s.running) == ["a", "long", "b"]


def test_rows_share_the_chunk_budget_and_only_the_last_stops_short() -> None:
    s, _ = scheduler(batch=8, chunk=16)
    for name, n in (("a", 4), ("b", 4), ("long", 30), ("c", 2)):
        s.add(row(name, n=n))
    # long gets the largest chunk that keeps 3 rows within 16 padded tokens; c waits behind it
    assert passes(s, 1) == [(0, [("a", 4), ("b", 4), ("long", 5)])]
    assert s.decoding == 2 and ids(s.waiting) == ["c"]
    assert passes(s, 3) == [(2, [("long", 16)]), (2, [("long", 9)]), (3, [("c", 2)])]  # 2 x 9 > 16, 8 < 9


def test_compaction_keeps_decoding_rows_before_prefilling_rows() -> None:
    s, moves = scheduler(batch=8, chunk=16)
    for name, n in (("d0", 4), ("d1", 4), ("d2", 4)):
        s.add(row(name, n=n))
    step(s)
    s.add(row("long", n=30))
    step(s)
    for i, r in enumerate(s.running[:3]):
        r.length = 10 + i
    assert ids(s.running) == ["d0", "d1", "d2", "long"] and s.running[3].length == 16
    s.running[0].handle.cancel()
    plan = step(s)
    assert [(r.request.request_id, why) for r, why in plan.retired] == [("d0", FinishReason.CANCELLED)]
    # d2 fills the decoding hole, long follows the decoding rows with its 16 prefilled tokens
    assert moves == [(2, 0, 12), (3, 2, 16)]
    assert ids(s.running) == ["d2", "d1", "long"] and plan.prefill_start == 2 and ids(plan.prefill) == ["long"]


def test_a_row_cancelled_mid_prefill_frees_its_slot_for_the_next() -> None:
    s, moves = scheduler(batch=2, chunk=8)
    s.add(row("a", n=4))
    s.add(row("long", n=30))
    s.add(row("next", n=4))
    assert passes(s, 2) == [(0, [("a", 4), ("long", 4)]), (1, [("long", 8)])]
    assert ids(s.waiting) == ["next"]  # both slots held
    s.running[1].handle.cancel()
    plan = step(s)
    assert [(r.request.request_id, why) for r, why in plan.retired] == [("long", FinishReason.CANCELLED)]
    assert ids(plan.prefill) == ["next"] and plan.prefill_start == 1 and ids(s.running) == ["a", "next"]
    assert moves == []


def test_prompt_blocks_in_the_prefix_cache_do_not_count_against_the_chunk_budget() -> None:
    keys: list[object] = []

    def cached(prompt: object, key: object) -> int:  # the runner's prefix-cache lookup: 24 of 30 tokens held
        keys.append(key)
        return 24

    s = Scheduler(SchedulerLimits(8, 8, False, prefill_chunk_tokens=16), lambda *a: None, cached=cached)
    for name in "abc":
        s.add(row(name, n=30, adapter=FakeAdapter() if name == "b" else None))
    plan = step(s)
    # 6 tokens each to compute: two rows fit 16 padded tokens (uncached, one row would take a 16-token chunk)
    assert ids(plan.prefill) == ["a", "b"] and plan.prefill_tokens == (6, 6) and ids(s.waiting) == ["c"]
    assert keys[:2] == [None, ("fake", 1.0)]  # looked up under the K/V key of each row's adapter


def test_rows_that_complete_through_cached_blocks_count_in_the_drafting_batch() -> None:
    heads = object()
    s = Scheduler(SchedulerLimits(8, 2, False, prefill_chunk_tokens=64), lambda *a: None, cached=lambda p, k: 24)
    for name in "abc":
        s.add(row(name, n=30, adapter=FakeAdapter(heads=heads)))
    plan = step(s)
    assert ids(plan.prefill) == ["a", "b", "c"] and plan.prefill_tokens == (6, 6, 6)
    assert not plan.draft  # all three complete and decode at this step: 3 > speculate_max_batch=2
