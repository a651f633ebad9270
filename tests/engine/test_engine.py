"""The engine in-process: continuous batching, batch invariance, cancellation, limits, stopping.

Every test but the one about the engine thread drives an engine never started with ``step()``: arrivals happen
between chosen steps, so each run is the same.
"""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.engines import (
    Events,
    generate,
    idle,
    make_engine,
    prompt,
    req,
    step_until,
    stepped_engine,
    tokens_of,
)

from service.engine.engine import Engine
from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.engine.sampling import SamplingParams
from service.errors import InvalidRequest, QueueFull, Unavailable

LIMITS = {"max_batch_size": 24, "max_total_tokens": 512, "max_prompt_tokens": 256}


@pytest.fixture(scope="module")
def engine(served_tiny_dir: Path) -> Iterator[Engine]:
    eng = stepped_engine(served_tiny_dir, **LIMITS)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def engine_int4(served_tiny_dir: Path) -> Iterator[Engine]:
    """The same engine on an int4-quantized base (batch invariance must hold there too)."""
    eng = stepped_engine(served_tiny_dir, quantize="int4", **LIMITS)
    yield eng
    eng.stop()


@pytest.mark.numerics
@pytest.mark.parametrize("base", ["engine", "engine_int4"])
def test_output_does_not_depend_on_the_batch(request: pytest.FixtureRequest, base: str) -> None:
    engine: Engine = request.getfixturevalue(base)
    target = req("target", prompt(0, 37), n=48)
    alone = tokens_of(generate(engine, target))
    assert len(alone) == 48

    events = Events()
    # 16 others of different lengths, arriving before, with and after the target.
    for i in range(6):
        events.submit(engine, req(f"early{i}", prompt(100 + i, 5 + 11 * i), n=20 + 7 * i))
    engine.step()
    engine.step()
    events.submit(engine, req("target2", target.prompt_ids, n=48))
    for i in range(10):
        if i % 3 == 1:  # late0 arrives with the target, the others over the next steps
            engine.step()
        events.submit(engine, req(f"late{i}", prompt(200 + i, 3 + 17 * i), n=10 + 5 * i))
    step_until(engine, events.finished)
    assert events.tokens("target2") == alone
    assert idle(engine)


def test_continuous_batching_admits_between_steps(engine: Engine) -> None:
    events = Events()
    events.submit(engine, req("long", prompt(1, 10), n=120))
    states = [engine.step() for _ in range(4)]
    assert len(events.tokens("long")) == 5  # prefill + decode at the first step, then one token per step
    events.submit(engine, req("short", prompt(2, 10), n=4))
    short_steps = step_until(engine, lambda: events.finished("short"))
    assert events.by_id["short"][-1].finish is FinishReason.LENGTH
    assert not events.finished("long"), "the short request should finish while the long one is still running"
    assert short_steps[0].running_ids == ("long", "short")
    states += short_steps + step_until(engine, events.finished)
    assert events.by_id["long"][-1].finish is FinishReason.LENGTH and len(events.tokens("long")) == 120
    assert max(s.running for s in states) >= 2  # both rows decoded in the same steps
    assert idle(engine)


def test_step_runs_prefill_and_decode_and_retires_deterministically(engine: Engine, served_tiny_dir: Path) -> None:
    alone = {rid: tokens_of(generate(engine, req(rid, prompt(i, 6 + i), n=3 + 2 * i))) for i, rid in enumerate("ab")}
    eng = stepped_engine(served_tiny_dir, max_batch_size=4, max_total_tokens=256, max_prompt_tokens=64)
    sinks = {rid: queue.SimpleQueue[TokenEvent]() for rid in "ab"}
    for i, rid in enumerate("ab"):
        eng.submit(req(rid, prompt(i, 6 + i), n=3 + 2 * i), sinks[rid].put)
    assert eng.in_flight == 2 and eng.state().steps == 0
    state = eng.step()  # prefill (one token each) and one decode step (another)
    assert state.running == 2 and state.running_ids == ("a", "b")
    assert [sinks[r].qsize() for r in "ab"] == [2, 2]
    state = eng.step()
    assert state.running == 1 and state.running_ids == ("b",)  # a: 3 tokens, finished and compacted away
    eng.step()
    state = eng.step()
    assert state.running == 0 and eng.in_flight == 0 and state.steps == 4
    for rid in "ab":
        events = [sinks[rid].get_nowait() for _ in range(sinks[rid].qsize())]
        assert events[-1].finish is FinishReason.LENGTH
        assert tokens_of(events) == alone[rid]
    eng.stop()


def test_cancellation_frees_the_slot(served_tiny_dir: Path) -> None:
    eng = stepped_engine(served_tiny_dir, max_batch_size=2, max_total_tokens=256, max_prompt_tokens=64)
    events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
    handle = eng.submit(req("to-cancel", prompt(3, 8), n=400), events.put)
    other = eng.submit(req("other", prompt(4, 8), n=400), lambda e: None)
    assert eng.step().running_ids == ("to-cancel", "other")
    handle.cancel()
    assert eng.in_flight == 1  # its queue place is back at once; its slot at the next step
    state = eng.step()
    assert state.running_ids == ("other",)  # the last row moved into the freed slot 0
    got = [events.get_nowait() for _ in range(events.qsize())]
    assert got[-1].finish is FinishReason.CANCELLED and [e.finish for e in got[:-1]] == [None, None]
    other.cancel()
    assert eng.step().running == 0 and eng.in_flight == 0
    eng.stop()


def test_deadline_retires_the_request(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    real, ahead = time.monotonic, [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: real() + ahead[0])  # the engine's clock, moved by the test
    events = Events()
    events.submit(engine, req("deadline", prompt(4, 8), n=400, deadline=time.monotonic() + 60))
    engine.step()
    engine.step()
    assert len(events.tokens("deadline")) == 3 and not events.finished()
    ahead[0] = 61.0  # the deadline passes between two steps
    engine.step()
    got = events.by_id["deadline"]
    assert got[-1].finish is FinishReason.DEADLINE
    assert len(tokens_of(got)) < 400
    assert len(tokens_of(got)) == 3 and idle(engine)  # retired before that step decoded


def test_seeded_sampling_is_reproducible_in_any_batch(engine: Engine) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = tokens_of(generate(engine, req("s1", prompt(5, 12), n=20, sampling=params)))
    events = Events()
    for i in range(4):
        events.submit(engine, req(f"noise{i}", prompt(50 + i, 9 + i), n=30, sampling=SamplingParams(temperature=1.0)))
    engine.step()  # the noise is decoding when the seeded request arrives
    events.submit(engine, req("s2", prompt(5, 12), n=20, sampling=params))
    step_until(engine, lambda: events.finished("s2"))
    assert events.tokens("s2") == alone
    events.submit(engine, req("s3", prompt(5, 12), n=20, sampling=SamplingParams(temperature=0.9, seed=99)))
    s3_steps = step_until(engine, lambda: events.finished("s3"))
    assert s3_steps[0].running == 5  # s3 too ran among the noise
    assert events.tokens("s3") != alone
    step_until(engine, lambda: idle(engine))


def test_eos_and_max_new_tokens(engine: Engine) -> None:
    events = generate(engine, req("len", prompt(6, 5), n=7))
    assert events[-1].finish is FinishReason.LENGTH and len(tokens_of(events)) == 7
    assert events[-1].generated_tokens == 7 and events[-1].prompt_tokens == 5
    # Make the first greedy token an end-of-sequence token: the request then ends with EOS after one token.
    first = tokens_of(generate(engine, req("probe", prompt(7, 6), n=1)))[0]
    eos_engine = Engine(engine.model, engine.tokenizer, engine.settings)
    eos_engine.eos_ids = frozenset({first})
    try:
        r = GenerationRequest(request_id="eos", prompt_ids=tuple(prompt(7, 6)), max_new_tokens=50)
        out = generate(eos_engine, r)
        assert out[-1].finish is FinishReason.EOS and tokens_of(out) == [first]
    finally:
        eos_engine.stop()


def test_stop_sequence_ends_generation(engine: Engine) -> None:
    full = generate(engine, req("full", prompt(8, 10), n=30))
    text = "".join(e.text for e in full)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    stopped = generate(engine, req("stopped", prompt(8, 10), n=30, stop_sequences=(stop,)))
    got = "".join(e.text for e in stopped)
    assert stopped[-1].finish is FinishReason.STOP_SEQUENCE
    assert got == text[: text.index(stop)]
    assert stopped[-1].stop_sequence == stop


def test_a_started_engine_serves_on_its_own_thread_until_stopped(engine: Engine, served_tiny_dir: Path) -> None:
    want = tokens_of(generate(engine, req("stepped", prompt(9, 7), n=6)))
    threaded = make_engine(served_tiny_dir, **LIMITS)
    try:
        assert threaded.alive
        with pytest.raises(RuntimeError, match="was started"):
            threaded.step()
        got = threaded.generate(req("threaded", prompt(9, 7), n=6), timeout=60)  # blocks on the request's queue
        assert got[-1].finish is FinishReason.LENGTH and tokens_of(got) == want
    finally:
        threaded.stop()
    assert not threaded.alive
    with pytest.raises(Unavailable):
        threaded.submit(req("late", prompt(9, 7)), lambda e: None)


def test_validation_and_queue_limit(served_tiny_dir: Path) -> None:
    eng = stepped_engine(served_tiny_dir, max_batch_size=1, max_queue=1, max_total_tokens=256, max_prompt_tokens=64)
    try:
        with pytest.raises(InvalidRequest, match="empty"):
            eng.submit(req("e", []), lambda e: None)
        with pytest.raises(InvalidRequest, match="at most 64"):
            eng.submit(req("long", prompt(0, 65)), lambda e: None)
        with pytest.raises(InvalidRequest, match="max_new_tokens"):
            eng.submit(req("zero", prompt(0, 5), n=0), lambda e: None)
        with pytest.raises(InvalidRequest, match="temperature"):
            eng.submit(req("t", prompt(0, 5), sampling=SamplingParams(temperature=-1)), lambda e: None)
        sinks = [queue.SimpleQueue[TokenEvent]() for _ in range(2)]
        handles = [eng.submit(req(f"q{i}", prompt(i, 5), n=150), sinks[i].put) for i in range(2)]
        with pytest.raises(QueueFull):
            eng.submit(req("overflow", prompt(9, 5)), lambda e: None)
        for h in handles:
            h.cancel()
        state = eng.step()  # both retired in one step
        assert state.running == state.waiting == eng.in_flight == 0
        # Capacity is back once the others are gone.
        after: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        eng.submit(req("after", prompt(9, 5), n=2), after.put)
        eng.step()  # prefill + one decode step: both tokens
        assert [after.get_nowait().finish for _ in range(2)] == [None, FinishReason.LENGTH]
    finally:
        eng.stop()


def test_a_cancelled_request_frees_its_queue_place_at_once(served_tiny_dir: Path) -> None:
    # The place used to come back only when the engine retired the row at its next step: a client re-using it
    # right after cancelling was refused (87 of 100 times over gRPC).
    eng = stepped_engine(served_tiny_dir, max_batch_size=1, max_queue=2, max_total_tokens=256, max_prompt_tokens=64)
    try:
        sinks = [queue.SimpleQueue[TokenEvent]() for _ in range(3)]
        handles = [eng.submit(req(f"q{i}", prompt(i, 5), n=200), sinks[i].put) for i in range(3)]
        assert eng.step().running_ids == ("q0",)  # q0 runs; q1, q2 wait: the queue is full
        for round_ in range(20):
            with pytest.raises(QueueFull):
                eng.submit(req("overflow", prompt(9, 5)), lambda e: None)
            victim = round_ % 3  # the running row, then waiting ones
            handles[victim].cancel()
            assert eng.in_flight == 2
            sinks[victim] = queue.SimpleQueue()
            handles[victim] = eng.submit(req(f"again{round_}", prompt(round_, 5), n=200), sinks[victim].put)
            assert eng.in_flight == 3
        handles[0].cancel()
        handles[0].cancel()  # a second cancel (and the row's own retirement) must not release twice
        assert eng.in_flight == 2
        for h in handles:
            h.cancel()
        state = eng.step()
        assert eng.in_flight == 0 and state.running == state.waiting == 0
    finally:
        eng.stop()


def test_speculation_governor_measures_then_picks_the_faster_and_probes() -> None:
    from service.engine.governor import SpeculationGovernor

    gov = SpeculationGovernor(min_samples=2, probe_every=4, probe_budget=1)
    seen = []
    for _ in range(4):  # 2 speculative steps, then 2 plain ones
        spec = gov.choose(1)
        seen.append(spec)
        gov.record(1, spec, 0.1, 1 if spec else 2)  # speculative: 10 tok/s, plain: 20 tok/s
    assert seen == [True, True, False, False]
    assert gov.rates(1) == (20.0, 10.0)
    picks = [gov.choose(1) for _ in range(8)]
    assert picks == [False, False, False, True, False, False, False, True]  # every 4th step probes
    gov.record(1, True, 0.1, 10)  # speculation got much faster (EWMA moves towards 100 tok/s)
    gov.record(1, True, 0.1, 10)
    assert gov.choose(1) is True
    assert gov.choose(4) is True  # another batch size is measured on its own


def _decide(gov: object, batch: int, spec_rate: float, plain_rate: float, steps: int) -> list[bool]:
    """``steps`` steps of ``batch`` rows where speculative steps run at ``spec_rate`` tok/s and plain ones at
    ``plain_rate``, each step taking one second: the governor's choices. (The tests of probe intervals give the
    governor ``probe_budget=1``: a probe's cost never spaces them further; see the test of that below.)"""
    from service.engine.governor import SpeculationGovernor

    assert isinstance(gov, SpeculationGovernor)
    picks = []
    for _ in range(steps):
        spec = gov.choose(batch)
        picks.append(spec)
        gov.record(batch, spec, 1.0, int(spec_rate if spec else plain_rate))
    return picks


def test_plain_probes_that_confirm_speculation_come_ever_rarer_and_a_change_resets_them() -> None:
    from service.engine.governor import SpeculationGovernor

    gov = SpeculationGovernor(min_samples=2, probe_every=4, max_probe_every=16, probe_budget=1)
    picks = _decide(gov, 1, spec_rate=90, plain_rate=30, steps=4 + 60)
    assert picks[:4] == [True, True, False, False]  # measuring: speculative first
    probes = [i - 4 for i, p in enumerate(picks) if not p and i >= 4]
    assert probes == [3, 11, 27, 43, 59]  # the 4th decided step, then 8 later, then 16 (the cap), 16, 16
    assert gov.probe_interval(1) == 16
    for _ in range(8):
        gov.record(1, True, 1.0, 10)  # speculation became much slower: the choice changes, probes come often again
    assert gov.rates(1)[1] < 30 and gov.choose(1) is False and gov.probe_interval(1) == 4


def test_speculative_probes_keep_their_interval_while_plain_wins() -> None:
    from service.engine.governor import SpeculationGovernor

    gov = SpeculationGovernor(min_samples=2, probe_every=4, max_probe_every=16, probe_budget=1)
    picks = _decide(gov, 1, spec_rate=10, plain_rate=30, steps=4 + 16)
    assert [i - 4 for i, p in enumerate(picks) if p and i >= 4] == [3, 7, 11, 15]  # a drafter's worth can change
    assert gov.probe_interval(1) == 4


def test_a_probe_that_beats_the_choice_starts_a_trial_that_can_change_it() -> None:
    from service.engine.governor import SpeculationGovernor

    gov = SpeculationGovernor(min_samples=2, probe_every=4, probe_budget=1)
    picks = _decide(gov, 1, spec_rate=10, plain_rate=30, steps=4 + 4)  # plain wins; one speculative probe
    assert picks == [True, True, False, False, False, False, False, True]
    # The text starts copying the prompt: drafts pay. The next probe is faster than plain: a trial of 2 speculative
    # steps follows it, and speculation wins from there.
    picks = _decide(gov, 1, spec_rate=90, plain_rate=30, steps=4 + 2 + 3)
    assert picks == [False, False, False, True, True, True, True, True, True]
    assert gov.rates(1)[1] > 30


def test_a_lucky_probe_whose_trial_keeps_the_choice_makes_probes_rarer() -> None:
    """A speculative probe that accepted a long draft beats plain once; its trial of slow steps keeps plain, and the
    next probe comes twice as late (a drafter that wins now and then by luck costs ever less); a trial that changes
    the choice resets the interval."""
    from service.engine.governor import SpeculationGovernor

    gov = SpeculationGovernor(min_samples=2, probe_every=4, max_probe_every=16, probe_budget=1)
    _decide(gov, 1, spec_rate=10, plain_rate=30, steps=4 + 3)  # plain chosen; the next step is a probe
    assert gov.choose(1) is True
    gov.record(1, True, 1.0, 60)  # the probe accepted a long draft: faster than plain, a trial of 2 follows
    picks = _decide(gov, 1, spec_rate=10, plain_rate=30, steps=2)
    assert picks == [True, True] and gov.rates(1)[1] < 30  # the trial's steps are slow: plain stays
    assert gov.probe_interval(1) == 8
    assert [i for i, p in enumerate(_decide(gov, 1, spec_rate=10, plain_rate=30, steps=16)) if p] == [7, 15]
    assert gov.choose(1) is False
    _decide(gov, 1, spec_rate=90, plain_rate=30, steps=8)  # the next probe wins and its trial switches
    assert gov.choose(1) is True and gov.probe_interval(1) == 4


def test_a_probe_within_the_margin_keeps_the_interval() -> None:
    from service.engine.governor import SpeculationGovernor

    gov = SpeculationGovernor(min_samples=2, probe_every=4, margin=0.2, probe_budget=1)
    picks = _decide(gov, 1, spec_rate=33, plain_rate=30, steps=4 + 12)  # speculation 10 % faster: not clear
    assert [i - 4 for i, p in enumerate(picks) if not p and i >= 4] == [3, 7, 11]
    assert gov.probe_interval(1) == 4


def test_a_new_batch_size_starts_from_its_decided_neighbours() -> None:
    from service.engine.governor import SpeculationGovernor

    gov = SpeculationGovernor(min_samples=2, probe_every=4, probe_budget=1)
    _decide(gov, 2, spec_rate=10, plain_rate=30, steps=4)  # batch 2: plain wins
    assert _decide(gov, 8, spec_rate=10, plain_rate=30, steps=3) == [False, False, False]  # larger: plain at once
    assert gov.choose(1) is True  # smaller: no neighbour says anything, measured from speculation
    _decide(gov, 1, spec_rate=50, plain_rate=30, steps=4)  # batch 1: speculation wins
    assert gov.rates(1) == (30.0, 50.0)
    fresh = SpeculationGovernor(min_samples=2, probe_every=4, probe_budget=1)
    _decide(fresh, 16, spec_rate=50, plain_rate=30, steps=4)  # speculation wins at 16: it wins below
    assert _decide(fresh, 4, spec_rate=50, plain_rate=30, steps=3) == [True, True, True]
    assert gov.choose(4) is False  # batch 1 won, batch 2 lost: for 4 only batch 2's loss speaks
    disagree = SpeculationGovernor(min_samples=2, probe_every=4, probe_budget=1)
    for batch, spec_rate in ((2, 10), (8, 50)):  # speculation lost at 2 but won at 8 (noise, another drafter)
        for spec in (True, True, False, False):
            disagree.record(batch, spec, 1.0, spec_rate if spec else 30)
    assert _decide(disagree, 4, spec_rate=50, plain_rate=30, steps=3) == [True, True, False]  # measured itself


def test_costly_probes_come_rarer_so_that_they_take_at_most_the_budget() -> None:
    """A speculative probe of 4 rows x 9 positions takes 6x a plain step (80 against 13.3 ms) and emits 5 tokens
    against the plain step's 4: it loses 80 - 5 / 300 tok/s = 63 ms. At a 3 % budget of 13.3 ms plain steps, probes
    come 159 steps apart, not 8: their share of the decode time stays near 3 %."""
    from service.engine.governor import SpeculationGovernor

    gov = SpeculationGovernor(min_samples=2, probe_every=8, max_probe_every=1024, probe_budget=0.03)
    for spec in (True, True, False, False):
        assert gov.choose(4) is spec
        gov.record(4, spec, 0.080 if spec else 0.0133, 5 if spec else 4)
    assert gov.probe_interval(4) == math.ceil((0.080 - 5 * 0.0133 / 4) / (0.03 * 0.0133)) == 159
    picks = [gov.choose(4) for _ in range(400)]
    assert [i for i, p in enumerate(picks) if p] == [158, 317]
    lost = 2 * (0.080 - 5 * 0.0133 / 4)
    assert lost / (398 * 0.0133 + 2 * 0.080) < 0.03
    # A probe that costs little keeps the interval: plain probes while speculation is clearly faster at batch 1
    # (plain 7.4 ms for 1 token, a verification 24 ms for 5) lose 7.4 - 24 / 5 = 2.6 ms each: 26 steps apart at 3 %
    # of 24 ms, less than the interval of 64, so 64 it stays.
    cheap = SpeculationGovernor(min_samples=2, probe_every=64, probe_budget=0.03)
    for spec in (True, True, False, False):
        cheap.record(1, spec, 0.024 if spec else 0.0074, 5 if spec else 1)
    assert cheap.choose(1) is True and cheap.probe_interval(1) == 64
    fresh = SpeculationGovernor(probe_budget=0.03)
    assert fresh.probe_interval(2) == fresh.probe_every  # nothing measured: the interval as set


def test_the_governor_refuses_settings_that_cannot_work() -> None:
    from service.engine.governor import SpeculationGovernor

    bad = ({"min_samples": 0}, {"probe_every": 1}, {"probe_every": 64, "max_probe_every": 32}, {"margin": 1},
           {"probe_budget": 0}, {"probe_budget": 1.5})  # fmt: skip
    for kwargs in bad:
        with pytest.raises(ValueError):
            SpeculationGovernor(**kwargs)  # type: ignore[arg-type]
