"""What crosses between the API edge and the engine thread: a request going in, events coming out.

The frontend builds a ``GenerationRequest`` from a checked domain call (``service.frontend.checks``); the engine
never sees protobuf. Events flow back through a sink callback that the engine calls on its own thread; the
frontend's sink hops onto the event loop with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.engine.sampling import SamplingParams
from service.errors import InvalidRequest

if TYPE_CHECKING:
    from service.constraints.backend import Grammar


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"
    DEAD_END = "dead_end"  # the output constraint allows no next token (its grammar can neither go on nor end)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter_id: str | None = None
    # The weighted adapters whose deltas the row sums (a mixture, or one adapter at a ``scale``), in request order;
    # ``adapter_id`` is then the first. Empty: ``adapter_id`` alone at weight 1.
    mix: tuple[tuple[str, float], ...] = ()
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculate: bool | None = None  # None: speculate when a drafter serves the row (Medusa heads, --draft)
    deadline: float | None = None  # time.monotonic() instant after which the request is dropped
    arrival: float = field(default_factory=time.monotonic)
    call_id: str = ""  # the id of the API call this request is part of (one of several prompts); empty: request_id
    grammar: Grammar | None = None  # the compiled output constraint every token must follow (None: free text)

    @property
    def deltas_key(self) -> tuple[tuple[str, float], ...] | None:
        """The weighted adapters of the row's deltas (what the batched math and its caches key by); None: base."""
        if self.mix:
            return self.mix
        return None if self.adapter_id is None else ((self.adapter_id, 1.0),)

    @property
    def log_id(self) -> str:
        """The ``request_id`` of this request's log lines: its call's id, as on the call's access line."""
        return self.call_id or self.request_id


def check_max_new_tokens(n: int, limit: int) -> None:
    """The one rule for ``max_new_tokens`` (1 to ``limit``): the API edge runs it before tokenizing, the engine's
    guard for programmatic callers runs the same function."""
    if not 0 < n <= limit:
        raise InvalidRequest(f"max_new_tokens must be in [1, {limit}], got {n}", field="max_new_tokens", limit=limit)


@dataclass(frozen=True)
class TokenEvent:
    """New output of one request. ``finish`` is set on the last event (and only there)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None = None
    finish: FinishReason | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    accepted_draft_tokens: int = 0
    stop_sequence: str = ""  # the stop sequence that matched, with FinishReason.STOP_SEQUENCE
    error: BaseException | None = None  # set with FinishReason.ERROR: a typed error for the edge to map


Sink = Callable[[TokenEvent], None]


class RequestHandle:
    """The submitter's side of a request: cancel it; the engine retires it (and frees its KV slot) at its next
    step. ``on_cancel`` runs at the first ``cancel``, on the caller's thread: the engine releases the request's
    place in the queue there, so a client re-using its capacity at once is not refused."""

    __slots__ = ("_cancelled", "_on_cancel", "request")

    def __init__(self, request: GenerationRequest, on_cancel: Callable[[RequestHandle], None] | None = None) -> None:
        self.request = request
        self._cancelled = threading.Event()
        self._on_cancel = on_cancel

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel(self)  # idempotent: two racing first cancels release once

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()
