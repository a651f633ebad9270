"""Shared helpers for in-process engine tests: a started engine over a model folder, requests, prompts, waiting.

Test modules import these (none imports another test module); a test that starts an engine stops it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from service.config import Settings
from service.engine.engine import Engine
from service.engine.request import GenerationRequest, TokenEvent
from service.model.weights import load_model
from service.tokenizer import Tokenizer


def make_engine(folder: Path, **overrides: object) -> Engine:
    """A started engine (fp32, CPU) over the model in ``folder`` with these settings."""
    settings = Settings(model=folder, **overrides).replace()  # type: ignore[arg-type]
    model, _, _ = load_model(folder, dtype=torch.float32, device=torch.device("cpu"))
    engine = Engine(model, Tokenizer.from_folder(folder), settings)
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


def wait_idle(engine: Engine, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        state = engine.state()  # published after each step: also wait for cancelled rows to leave their slots
        if engine.in_flight == 0 and state.running == 0 and state.waiting == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.state()}")
