"""Shared helpers for in-process engine tests: engines over a model folder, requests, prompts, stepping.

Tests drive an engine never started with ``Engine.step()`` (deterministic: events reach the sinks on the test's
own thread, during the step); only tests about the engine thread itself start one. Test modules import these (none
imports another test module); a test that starts an engine stops it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from service.config import Settings
from service.constraints.cache import GrammarCache
from service.constraints.llg import LLGuidanceBackend
from service.engine.engine import Engine, EngineState
from service.engine.request import GenerationRequest, RequestHandle, TokenEvent
from service.model.config import ModelConfig
from service.model.load_folder import load_model
from service.tokenizer import Tokenizer


def stepped_engine(folder: Path, grammars: GrammarCache | None = None, **overrides: object) -> Engine:
    """An engine (fp32, CPU) over the model in ``folder`` with these settings (``quantize`` included), never
    started: the test drives it with ``step()``. With ``grammars``, it serves their constraints."""
    settings = Settings(model=folder, dtype="float32", **overrides).replace()  # type: ignore[arg-type]
    quantize = None if settings.quantize == "none" else settings.quantize
    model, _, _ = load_model(
        folder, dtype=torch.float32, device=torch.device("cpu"), quantize=quantize,  # type: ignore[arg-type]
        group_size=settings.quantize_group_size,
    )  # fmt: skip
    backend = grammars.backend if grammars is not None else None
    return Engine(model, Tokenizer.from_folder(folder), settings, constraints=backend)


def grammar_cache(folder: Path, budget_bytes: int = 64 << 20) -> GrammarCache:
    """The server's constraint backend (llguidance) for the model in ``folder``, behind a cache."""
    tokenizer = Tokenizer.from_folder(folder)
    cfg = ModelConfig.from_hf(folder)
    eos = sorted(set(tokenizer.eos_token_ids) | set(cfg.eos_token_ids))
    return GrammarCache(LLGuidanceBackend(tokenizer.to_json(), cfg.vocab_size, eos, max_depth=32), budget_bytes)


def make_engine(folder: Path, **overrides: object) -> Engine:
    """A started engine (its own thread) over the model in ``folder`` with these settings."""
    engine = stepped_engine(folder, **overrides)
    engine.start()
    return engine


def req(rid: str, prompt: list[int], n: int = 24, **kw: object) -> GenerationRequest:
    """Exactly ``n`` new tokens (EOS ignored) after ``prompt``."""
    return GenerationRequest(request_id=rid, prompt_ids=tuple(prompt), max_new_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def prompt(seed: int, length: int) -> list[int]:
    """``length`` seeded random token ids from SmolLM2's vocabulary (no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (length,), generator=g).tolist()


class Events:
    """Every submitted request's events by request id, as a stepped engine delivers them."""

    def __init__(self) -> None:
        self.by_id: dict[str, list[TokenEvent]] = {}

    def submit(self, engine: Engine, request: GenerationRequest) -> RequestHandle:
        events = self.by_id[request.request_id] = []
        return engine.submit(request, events.append)

    def finished(self, *rids: str) -> bool:
        """Whether each of ``rids`` (all submitted requests if none given) has had its final event."""
        return all(self.by_id[r] and self.by_id[r][-1].finish is not None for r in rids or self.by_id)

    def tokens(self, rid: str) -> list[int]:
        return tokens_of(self.by_id[rid])


def step_until(
    engine: Engine, done: Callable[[], bool], max_steps: int = 2000, timeout: float = 120.0
) -> list[EngineState]:
    """Step ``engine`` until ``done()``; the state after each step. A step that ran nothing while rows wait (for an
    adapter loading on its own thread) does not count against ``max_steps``: it waits a millisecond instead, for at
    most ``timeout`` seconds in all, so a slow load on a busy machine is not a failure."""
    states: list[EngineState] = []
    counted, deadline = 0, time.monotonic() + timeout
    while not done():
        if counted == max_steps or time.monotonic() > deadline:
            raise AssertionError(f"not done after {counted} steps: {engine.state()}")
        state = engine.step()
        states.append(state)
        if state.running == 0 and state.waiting > 0:
            time.sleep(0.001)
        else:
            counted += 1
    return states


def idle(engine: Engine) -> bool:
    """Nothing queued, waiting or running (cancelled rows included: they leave their slots at a step)."""
    state = engine.state()
    return engine.in_flight == 0 and state.running == 0 and state.waiting == 0


def run(engine: Engine, *requests: GenerationRequest) -> dict[str, list[TokenEvent]]:
    """Submit ``requests`` together and step until each has finished (other requests may still be running)."""
    events = Events()
    for r in requests:
        events.submit(engine, r)
    step_until(engine, events.finished)
    return events.by_id


def generate(engine: Engine, request: GenerationRequest) -> list[TokenEvent]:
    """All events of one request, stepping ``engine`` until it finishes."""
    return run(engine, request)[request.request_id]


def run_together(
    engine: Engine, requests: list[GenerationRequest], timeout: float = 60.0
) -> dict[str, list[TokenEvent]]:
    """Run ``requests`` on a started engine, admitted in one step: a one-token gate request holds the engine thread
    in its sink until every request is queued. For engines whose rows wait on work off the engine thread (adapter
    loads); the others are stepped."""
    release, held = threading.Event(), threading.Event()

    def gate(event: TokenEvent) -> None:
        held.set()
        release.wait(10)

    engine.submit(GenerationRequest(request_id="gate", prompt_ids=(1, 2, 3), max_new_tokens=1), gate)
    assert held.wait(10), "the gate request never ran"
    sinks: dict[str, queue.SimpleQueue[TokenEvent]] = {}
    for r in requests:
        sinks[r.request_id] = queue.SimpleQueue()
        engine.submit(r, sinks[r.request_id].put)
    release.set()
    out: dict[str, list[TokenEvent]] = {}
    for rid, sink in sinks.items():
        events = out[rid] = []
        while not events or events[-1].finish is None:
            events.append(sink.get(timeout=timeout))
    return out
