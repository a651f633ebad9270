"""One request's state inside the engine: what the scheduler, the runner and the output processor share.

A ``Row`` is created on the engine thread when a submission is taken from the inbox and lives until it is
retired; only the engine thread touches it. ``length`` counts the tokens whose K/V are in the row's slot (the
runner advances it; below the prompt's length the row is still being prefilled, one chunk per step); ``pending``
is the last emitted token, fed at the next decode step (the output processor sets it). This module imports no
torch: the scheduler and its tests run without it.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.engine.request import GenerationRequest, RequestHandle, Sink

if TYPE_CHECKING:
    from service.adapters.handle import Adapter
    from service.constraints.backend import Matcher
    from service.drafters.base import Draft, Drafter
    from service.engine.detok import IncrementalDetokenizer
    from service.engine.sampling import RandomStream
    from service.engine.stops import StopMatcher


@dataclass(eq=False)
class Row:
    handle: RequestHandle
    sink: Sink
    detok: IncrementalDetokenizer
    stops: StopMatcher | None
    generator: RandomStream | None
    ids: list[int]  # prompt + generated, for the repetition penalty and the drafters
    adapter: Adapter | None = None  # resolved once, at submit
    length: int = 0  # tokens whose K/V are in the cache
    pending: int = -1  # last sampled token, fed at the next decode step
    generated: int = 0
    deltas: bool = False  # its adapter's per-layer deltas apply to its rows of the batch (from admission)
    drafter: Drafter | None = None  # proposes its draft tokens (greedy rows only; from admission)
    kv_key: Hashable | None = None  # what besides the tokens shapes its K/V (e.g. the LoRA registration)
    draft: Draft | None = None  # drafted tokens to verify at the next step
    matcher: Matcher | None = None  # where its output is in its constraint's grammar (None: unconstrained)
    accepted: int = 0  # draft tokens accepted so far
    done: bool = False  # leaves its slot at the next compaction
    closed: bool = False  # its final event is delivered and its adapter released
    enqueued: float = field(default_factory=time.monotonic)
    last_token_at: float = 0.0

    @property
    def request(self) -> GenerationRequest:
        return self.handle.request

    @property
    def drafted(self) -> int:
        """Draft tokens it holds for the next step."""
        return 0 if self.draft is None else self.draft.size

    @property
    def remaining(self) -> int:
        """Prompt tokens whose K/V are not in the slot yet."""
        return len(self.handle.request.prompt_ids) - self.length

    @property
    def prefilling(self) -> bool:
        """Part-way through its prompt (chunked prefill, or admitted and not yet prefilled): it does not decode."""
        return self.length < len(self.handle.request.prompt_ids)


__all__ = ["Row"]
