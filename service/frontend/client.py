"""The engine client both edges call: a checked domain call in, completions or a stream of events out.

Order inside every call: the cheap checks on the event loop (``checks.check``; a call over a limit is refused
before any of its prompts is tokenized), then tokenization and chat templating on the runtime's worker pool (a
large prompt never stalls other calls or health), then the engine's own check of every input (a call is refused
as a whole before any part of it runs), then submission. Engine events cross from the engine thread to the event
loop through one ``_Mailbox`` per loop. A failed generation raises its typed error; the edges map it.

It never builds a wire message or a status and never counts a call: it only tells the current call's observer
(``service.frontend.observer``) its tokens.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Protocol, TypeVar

from service.config import Settings
from service.constraints.backend import Grammar
from service.constraints.cache import GrammarCache
from service.engine.engine import Engine
from service.engine.request import FinishReason, GenerationRequest, RequestHandle, TokenEvent
from service.errors import DeadlineExceeded, InvalidRequest, LoraplexError, Unavailable
from service.frontend import checks, observer
from service.frontend.prompts import Prompt, Tokenized, prompt_of, tokenize
from service.frontend.request import Completion, Generated, GenerationCall, Input
from service.tokenizer import Tokenizer

T = TypeVar("T")


class Ready(Protocol):
    """What the frontend needs of a loaded runtime."""

    @property
    def settings(self) -> Settings: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def grammars(self) -> GrammarCache | None: ...


class Serving(Protocol):
    """What the frontend needs of the runtime: its serving state and its worker pool."""

    def ready(self) -> Ready: ...
    async def off_loop(self, fn: Callable[..., T], *args: object) -> T: ...


class _Mailbox:
    """Engine-thread events into one event loop with one wake-up per burst instead of one per token.

    The engine emits a token for every running stream at the end of each step; ``call_soon_threadsafe`` per event
    would write the loop's wake-up pipe once per stream per step. Here the first event of a burst schedules a
    drain and the rest only append, so the loop wakes about once per step (on a 2-core machine every wake-up runs
    beside the step's compute threads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[tuple[asyncio.Queue[TokenEvent], TokenEvent]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue[TokenEvent], event: TokenEvent) -> None:
        with self._lock:
            self._items.append((queue, event))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for queue, event in items:
            queue.put_nowait(event)


class Frontend:
    def __init__(self, runtime: Serving) -> None:
        self.runtime = runtime
        self._mailbox: _Mailbox | None = None

    async def _prompt(self, item: Input, tokenizer: Tokenizer) -> Prompt:
        return await self.runtime.off_loop(prompt_of, item, tokenizer)

    async def _prompts(self, rt: Ready, call: GenerationCall) -> list[Prompt]:
        return await asyncio.gather(*(self._prompt(item, rt.tokenizer) for item in call.inputs))

    async def _grammar(self, rt: Ready, call: GenerationCall) -> Grammar | None:
        """The call's compiled constraint (from the cache, or compiled on the worker pool), or None."""
        if call.constraint is None:
            return None
        if rt.grammars is None:
            raise InvalidRequest("this server serves no output constraints", field="constraint")
        limit = rt.settings.max_constraint_compile_seconds
        try:  # the compile goes on past the limit (it cannot be interrupted) and its result is cached
            return await asyncio.wait_for(asyncio.wrap_future(rt.grammars.submit(call.constraint)), limit)
        except TimeoutError:
            raise InvalidRequest(
                f"the constraint did not compile within {limit:g} s (--max-constraint-compile-seconds); simplify it",
                field="constraint",
                limit=limit,
            ) from None

    def _submit(self, rt: Ready, request: GenerationRequest) -> tuple[RequestHandle, asyncio.Queue[TokenEvent]]:
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = _Mailbox(loop)
        mailbox = self._mailbox
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:  # engine thread -> event loop
            mailbox.post(events, event)

        handle = rt.engine.submit(request, sink)  # the engine's own check runs there, once
        observer.submitted(len(request.prompt_ids))
        return handle, events

    async def generate(self, call: GenerationCall) -> Generated:
        """Every input of ``call`` to its end: one completion per input, in order."""
        rt = self.runtime.ready()
        checked = checks.check(call, rt.settings)
        observer.labelled(checked.adapter_id)
        grammar, prompts = await asyncio.gather(self._grammar(rt, call), self._prompts(rt, call))  # side by side
        requests = [checks.engine_request(checked, prompt, i, grammar) for i, prompt in enumerate(prompts)]
        for request in requests:  # refuse the whole call before any part of it runs
            rt.engine.validate(request)
        submitted: list[tuple[RequestHandle, asyncio.Queue[TokenEvent]]] = []
        try:
            for request in requests:
                submitted.append(self._submit(rt, request))
            completions = tuple([await _collect(events) for _, events in submitted])
        finally:
            for handle, _ in submitted:
                handle.cancel()
        return Generated(checked.request_id, completions)

    async def stream(self, call: GenerationCall) -> AsyncGenerator[TokenEvent, None]:
        """The events of a one-input ``call`` as they come, the last one with ``finish`` set. Closing it cancels
        the request (its KV slot is freed at the engine's next step)."""
        rt = self.runtime.ready()
        checked = checks.check(call, rt.settings)
        observer.labelled(checked.adapter_id)
        grammar, prompt = await asyncio.gather(self._grammar(rt, call), self._prompt(call.inputs[0], rt.tokenizer))
        handle, events = self._submit(rt, checks.engine_request(checked, prompt, 0, grammar))
        try:
            while True:
                event = await events.get()
                observer.observe(event)
                raise_if_failed(event)
                yield event
                if event.finish is not None:
                    return
        finally:
            handle.cancel()  # a no-op when finished; frees the slot when the client went away

    async def tokenize(self, item: Input) -> Tokenized:
        """``item``'s token ids, tokens and templated text (its size checked first, on the event loop)."""
        rt = self.runtime.ready()
        checks.check_input(item, rt.settings)
        return await self.runtime.off_loop(tokenize, item, rt.tokenizer)


async def _collect(events: asyncio.Queue[TokenEvent]) -> Completion:
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[float] = []
    while True:
        event = await events.get()
        observer.observe(event)
        raise_if_failed(event)
        text.append(event.text)
        token_ids.extend(event.token_ids)
        if event.logprobs is not None:
            logprobs.extend(event.logprobs)
        if event.finish is not None:
            return Completion(
                text="".join(text),
                token_ids=tuple(token_ids),
                logprobs=tuple(logprobs),
                finish=event.finish,
                stop_sequence=event.stop_sequence,
                prompt_tokens=event.prompt_tokens,
                generated_tokens=event.generated_tokens,
                accepted_draft_tokens=event.accepted_draft_tokens,
            )


def raise_if_failed(event: TokenEvent) -> None:
    """Raise the typed error of an event that ends its request by failing (deadline, engine error)."""
    if event.finish is FinishReason.DEADLINE:
        raise DeadlineExceeded("the request's deadline passed before generation finished")
    if event.finish is FinishReason.ERROR:
        if isinstance(event.error, LoraplexError):
            raise event.error.fresh()  # never the instance itself: one may be shared by many requests
        if event.error is not None:
            raise event.error
        raise Unavailable("generation failed")
