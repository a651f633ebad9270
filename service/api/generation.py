"""The `loraplex.v1.Generation` servicer: thin methods that convert, submit to the engine and relay events.

Order inside every method: cheap per-field checks on the event loop (``convert.precheck``), then tokenization
and chat templating on the runtime's worker pool (a large prompt never stalls other RPCs or health), then
submission. A request over a limit is refused before any of its prompts is tokenized. Auth, error statuses and
metrics are the interceptors' (``service.api.interceptors``): a method raises typed errors and never builds a
status or counts a request itself; it only tells the call's access record (``service.api.access``) its tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator

from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc

from service import __version__
from service.api import access, convert, limits
from service.api.runtime import Runtime
from service.api.status import Context
from service.engine.request import FinishReason, GenerationRequest, RequestHandle, TokenEvent
from service.errors import DeadlineExceeded, LoraplexError, Unavailable

LIMIT_FIELDS = tuple(pb.Limits.DESCRIPTOR.fields_by_name)
"""``ModelInfo.limits``: each field of the message is the ``Settings`` field of the same name."""


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


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._mailbox: _Mailbox | None = None

    def _deadline(self, context: Context) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None else time.monotonic() + remaining

    def _submit(self, request: GenerationRequest) -> tuple[RequestHandle, asyncio.Queue[TokenEvent]]:
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = _Mailbox(loop)
        mailbox = self._mailbox
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:  # engine thread -> event loop
            mailbox.post(events, event)

        handle = self.runtime.submit(request, sink)
        access.submitted(len(request.prompt_ids))
        return handle, events

    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        return await self.generate(request, self._deadline(context))

    async def generate(self, request: pb.GenerateRequest, deadline: float | None) -> pb.GenerateResponse:
        """``Generate`` for any edge: ``deadline`` is a ``time.monotonic()`` instant, or None (the HTTP API)."""
        rt = self.runtime.ready()
        checked = convert.precheck(request, rt.settings)
        prompts = await asyncio.gather(*(self.runtime.prompt(item) for item in request.inputs))
        domain = [
            convert.generation_request(request, checked, prompt, deadline=deadline, index=i)
            for i, prompt in enumerate(prompts)
        ]
        for item in domain:  # refuse the whole request before any part of it runs
            rt.validate(item)
        submitted: list[tuple[RequestHandle, asyncio.Queue[TokenEvent]]] = []
        try:
            for item in domain:
                submitted.append(self._submit(item))
            results = [await self._collect(events, request.return_options) for _, events in submitted]
        finally:
            for handle, _ in submitted:
                handle.cancel()
        return pb.GenerateResponse(results=results, request_id=checked.request_id)

    async def _collect(self, events: asyncio.Queue[TokenEvent], options: pb.ReturnOptions) -> pb.GenerationResult:
        result = pb.GenerationResult()
        text: list[str] = []
        while True:
            event = await events.get()
            access.observe(event)
            _raise_if_failed(event)
            text.append(event.text)
            if options.return_token_ids:
                result.token_ids.extend(event.token_ids)
            if options.return_logprobs and event.logprobs is not None:
                result.logprobs.extend(event.logprobs)
            if event.finish is not None:
                result.text = "".join(text)
                result.finish_reason = convert.FINISH_TO_PB[event.finish]
                result.stop_sequence = event.stop_sequence
                result.usage.CopyFrom(convert.usage_of(event))
                return result

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: Context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with contextlib.aclosing(self.stream(request, self._deadline(context))) as responses:
            async for response in responses:
                yield response

    async def stream(
        self, request: pb.GenerateStreamRequest, deadline: float | None
    ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        """``GenerateStream`` for any edge (``deadline`` as in ``generate``). Closing it cancels the request."""
        checked = convert.precheck(request, self.runtime.ready().settings)
        prompt = await self.runtime.prompt(request.input)
        domain = convert.generation_request(request, checked, prompt, deadline=deadline)
        handle, events = self._submit(domain)
        first = True
        try:
            while True:
                event = await events.get()
                access.observe(event)
                _raise_if_failed(event)
                response = convert.stream_response(event, request.return_options)
                if first:
                    response.request_id = checked.request_id
                    first = False
                yield response
                if event.finish is not None:
                    return
        finally:
            handle.cancel()  # a no-op when finished; frees the slot when the client went away

    async def Tokenize(self, request: pb.TokenizeRequest, context: Context) -> pb.TokenizeResponse:
        rt = self.runtime.ready()
        limits.check_input(request.input, rt.settings)
        return await self.runtime.off_loop(convert.tokenize_response, request.input, rt.tokenizer)

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: Context) -> pb.ModelInfoResponse:
        rt = self.runtime.ready()
        s = rt.settings
        cfg = rt.model_config
        features = ["lora", "medusa", "logprobs", "stop_sequences", "seed"]
        if rt.tokenizer.has_chat_template:
            features.append("chat_template")
        return pb.ModelInfoResponse(
            model_name=s.model.resolve().name,
            model_path=str(s.model),
            architecture=cfg.architecture,
            dtype=rt.dtype,
            device=str(rt.device),
            vocab_size=cfg.vocab_size,
            context_length=cfg.max_position_embeddings,
            limits=pb.Limits(**{name: getattr(s, name) for name in LIMIT_FIELDS}),
            features=features,
            server_version=__version__,
            load_mode="gguf" if rt.weights == "gguf" else s.load_mode,
            load_seconds=rt.load_seconds,
            eos_token_ids=sorted(rt.engine.eos_ids),
            cpu_capability=rt.self_check.capability,
            weights=rt.weights,
            compute_paths=[
                pb.ComputePath(path=c.path, kernel=c.kernel, error=c.error, tolerance=c.tolerance, status=c.status)
                for c in rt.self_check.checks
            ],
        )


def _raise_if_failed(event: TokenEvent) -> None:
    if event.finish is FinishReason.DEADLINE:
        raise DeadlineExceeded("the request's deadline passed before generation finished")
    if event.finish is FinishReason.ERROR:
        if isinstance(event.error, LoraplexError):
            raise event.error.fresh()  # never the instance itself: one may be shared by many requests
        if event.error is not None:
            raise event.error
        raise Unavailable("generation failed")
