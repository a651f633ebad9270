"""The OpenAI-compatible routes: a Starlette app over the frontend (``service.frontend.Frontend``), beside gRPC.

Order in every route, as in the gRPC interceptor chain: the API key (``KeyRing``, the generate role) before the
body is read; the serving state (``Runtime.ready``: 503 while loading or draining); the body, bounded by
``--max-message-bytes`` while it is read; the parameters (``params``: OpenAI JSON -> a domain call); then the
frontend's generation path with its checks. Every call is reported by the call observer
(``service.frontend.observer``), as gRPC calls are: one ``loraplex_requests_total`` sample,
``method="http.chat"`` / ``"http.completions"`` / ``"http.models"`` (vLLM's adapter routes,
``service.api.http.adapters``: ``"http.load_lora_adapter"`` / ``"http.unload_lora_adapter"``), ``code`` = the gRPC
status name of the outcome (the same label values as gRPC's), one ``loraplex_adapter_requests_total`` sample per
generation, and one ``event=access`` line on ``loraplex.access``.

A client that goes away cancels its generation: a non-streamed call races the generation against the connection's
``http.disconnect``; a stream is closed by Starlette's disconnect watch, and closing it cancels every choice's
request in the engine (its KV slot is freed at the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from service.adapters.catalog import AdapterCatalog
from service.adapters.common.ids import check_adapter_id
from service.adapters.lora.part import LoraPart
from service.adapters.medusa.part import MedusaPart
from service.api.auth import KeyRing
from service.api.http import errors, params, structured
from service.api.http.adapters import AdapterRoutes
from service.api.http.replies import Replies
from service.api.runtime import Runtime
from service.errors import AdapterNotFound, InvalidRequest
from service.frontend import Frontend, TokenEvent, checks, observer
from service.frontend.observer import ObservedCall
from service.logs import REQUEST_ID_HEADER, new_request_id

T = TypeVar("T")

GENERATE_METHOD = "/loraplex.v1.Generation/Generate"
"""The gRPC method whose role every route needs (``KeyRing.authorize``): generate."""

MODELS_PATH = "/v1/models/"
JSON_OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are parsed on the runtime's worker pool


class ClientGone(Exception):
    """The client closed its connection before its reply was ready."""


class OpenAIRoutes:
    def __init__(self, runtime: Runtime, frontend: Frontend, keys: KeyRing) -> None:
        self.runtime = runtime
        self.frontend = frontend
        self.keys = keys
        self.created = int(time.time())  # ``created`` of every model card: when this server started
        self.base_name = runtime.settings.model.resolve().name  # ``model`` of the base: its folder's name, as
        # ModelInfo.model_name (resolved once: no file system call per request on the event loop)
        self.adapter_routes = AdapterRoutes(runtime, keys, self._observe, self._body)

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.adapter_routes.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.adapter_routes.unload, methods=["POST"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})

    def _observe(self, method: str, request: Request) -> ObservedCall:
        """The call's observer: its id is a valid ``x-request-id`` header, else a new one. uvicorn runs each request
        in a task of its own (the streams' tasks inherit it), so it stays the call's for the rest of the request."""
        header = request.headers.get(REQUEST_ID_HEADER, "")
        request_id = header if checks.is_request_id(header) else new_request_id()
        peer = "" if request.client is None else observer.peer_of(request.client.host, request.client.port)
        return observer.begin(method, request_id, peer, self.runtime.knows_adapter)

    # ----------------------------------------------------------------------------------------------- models

    async def models(self, request: Request) -> Response:
        return await self._listing(request, None)

    async def model(self, request: Request) -> Response:
        # The path's own tail, not the route's match: its pattern ends in `$`, which also matches before a trailing
        # newline (`/v1/models/caps%0A` would be `caps`).
        path: str = request.scope["path"]
        name = path.partition(MODELS_PATH)[2] if path.startswith(MODELS_PATH) else request.path_params["model"]
        return await self._listing(request, name)

    async def _listing(self, request: Request, name: str | None) -> Response:
        outcome = self._observe("http.models", request)
        try:
            self._authorize(request)
            cards = self._cards()
            if name is not None:
                card = next((c for c in cards if c["id"] == name), None)
                if card is None:
                    check_adapter_id(name, field="model")  # malformed: 400, well-formed but unknown: 404
                    raise AdapterNotFound(name)
                body: dict[str, Any] = card
            else:
                body = {"object": "list", "data": cards}
        except Exception as exc:
            outcome.finish(errors.status_name(exc))
            return _error(exc, chat=False, request_id=outcome.request_id)
        outcome.finish("OK")
        return JSONResponse(body, headers={REQUEST_ID_HEADER: outcome.request_id})

    def _cards(self) -> list[dict[str, Any]]:
        rt = self.runtime.ready()
        base, created = self.base_name, self.created
        cards = [{"id": base, "object": "model", "created": created, "owned_by": "loraplex", "root": base}]
        for adapter_id in rt.adapters.ids():
            if adapter_id != base:
                root = rt.adapters.source_of(adapter_id) or base  # as vLLM: the adapter's path, as loaded
                cards.append(
                    {"id": adapter_id, "object": "model", "created": created, "owned_by": "loraplex",
                     "root": root, "parent": base, "loraplex": _describe(rt.adapters, adapter_id)}
                )  # fmt: skip
        return cards

    def _adapter_of(self, model: str) -> str:
        """The adapter id a ``model`` names ("" = the base model): 400 for a name that cannot be an adapter id, 404
        for one that is not registered (the same rule as gRPC's ``adapter_id``, ``service.adapters.common.ids``)."""
        if model == self.base_name:
            return ""
        check_adapter_id(model, field="model")
        if not self.runtime.knows_adapter(model):
            raise AdapterNotFound(model)
        return model

    def _authorize(self, request: Request) -> None:
        header = request.headers.get("authorization")
        self.keys.authorize(GENERATE_METHOD, [] if header is None else [("authorization", header)])

    # ------------------------------------------------------------------------------------------- generation

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def _generate(self, request: Request, kind: params.Kind) -> Response:
        outcome = self._observe(f"http.{kind}", request)
        chat = kind == "chat"
        call: params.Call | None = None
        try:
            self._authorize(request)
            rt = self.runtime.ready()
            body = await self._body(request, rt.settings.max_message_bytes)
            request_id = outcome.request_id
            header = request.headers.get(REQUEST_ID_HEADER, "")
            if header:  # an invalid one is refused (400) naming the header, never used or echoed
                request_id = checks.request_id_of(header)
            call = params.parse(
                kind, body, request_id=request_id, adapter_of=self._adapter_of,
                constraint_limits=rt.settings.constraint_limits,
            )  # fmt: skip
            outcome.adapter, outcome.per_adapter = call.request.adapter_id, True
            replies = Replies(call, request_id, rt.tokenizer)
            headers = {REQUEST_ID_HEADER: request_id}
            if call.stream:
                return await self._stream(request, call, replies, outcome, headers)
            response = await _until_disconnect(request, self.frontend.generate(call.request))
        except ClientGone:
            outcome.finish("CANCELLED")
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        except Exception as exc:
            outcome.finish(errors.status_name(exc))
            exc = structured.rename(exc, None if call is None else call.constraint_param)  # names its parameter
            return _error(exc, chat=chat, request_id=outcome.request_id, model=None if call is None else call.model)
        outcome.finish("OK")
        return JSONResponse(replies.completion(response), headers=headers)

    async def _body(self, request: Request, limit: int) -> object:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            if len(raw) > JSON_OFF_LOOP_BYTES:
                return await self.runtime.off_loop(json.loads, raw)
            return json.loads(raw)
        except ValueError:  # UnicodeDecodeError included
            raise InvalidRequest("the request body is not valid JSON") from None

    async def _stream(
        self, request: Request, call: params.Call, replies: Replies, outcome: ObservedCall, headers: dict[str, str]
    ) -> Response:
        """Start every choice's stream and wait for the first reply before answering, so a request refused by
        the engine (queue full, bad prompt) still gets its HTTP status instead of a 200 stream with an error."""
        streams = _merged([self.frontend.stream(call.choice(i)) for i in range(call.choices)])
        try:
            first = await _until_disconnect(request, anext(streams))
        except BaseException:
            await streams.aclose()
            raise
        headers = {**headers, "cache-control": "no-cache", "x-accel-buffering": "no"}
        return _EventStream(_events(first, streams, replies, outcome), streams, outcome, headers)


class _EventStream(StreamingResponse):
    """An SSE response whose streams are closed however it ends: also when the client left before its first event
    was sent (Starlette then never starts the body, so the body's own ``finally`` would not run)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        streams: AsyncGenerator[tuple[int, TokenEvent], None],
        outcome: ObservedCall,
        headers: dict[str, str],
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._streams, self._outcome = streams, outcome

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._outcome.finish("CANCELLED")  # a no-op when the stream ended by itself
            await self._streams.aclose()


async def _events(
    first: tuple[int, TokenEvent], rest: AsyncGenerator[tuple[int, TokenEvent], None],
    replies: Replies, outcome: ObservedCall,
) -> AsyncIterator[bytes]:  # fmt: skip
    """The SSE body: ``data: <chunk>`` per reply, the usage chunk when asked, ``data: [DONE]``. An error after the
    headers went out is sent as a last ``data: {"error": ...}`` event (there is no status left to set)."""
    code = "CANCELLED"  # unless the stream ends otherwise: the client went away, Starlette cancelled this
    try:
        for chunk in replies.chunks(*first):
            yield _sse(chunk)
        async for index, response in rest:
            for chunk in replies.chunks(index, response):
                yield _sse(chunk)
        if replies.call.include_usage:
            yield _sse(replies.usage_chunk())
        yield b"data: [DONE]\n\n"
        code = "OK"
    except Exception as exc:
        code = errors.status_name(exc)
        exc = structured.rename(exc, replies.call.constraint_param)
        yield _sse(errors.error_body(exc, chat=replies.chat, where="stream"))
    finally:
        outcome.finish(code)
        await rest.aclose()


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _merged(
    streams: list[AsyncGenerator[TokenEvent, None]],
) -> AsyncGenerator[tuple[int, TokenEvent], None]:
    """``(choice index, reply)`` of every stream as they come; the first error ends all of them. Closing this
    closes every stream (each cancels its request)."""
    queue: asyncio.Queue[tuple[int, TokenEvent | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[TokenEvent, None]) -> None:
        async with contextlib.aclosing(stream):
            try:
                async for response in stream:
                    queue.put_nowait((index, response, None))
            except Exception as exc:
                queue.put_nowait((index, None, exc))
                return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, response, exc = await queue.get()
            if exc is not None:
                raise exc
            if response is None:
                running -= 1
                continue
            yield index, response
    finally:
        for task in tasks:
            task.cancel()  # synchronous, so it happens even when this generator is being cancelled itself
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled and ``ClientGone`` raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _too_large(limit: int) -> InvalidRequest:
    return InvalidRequest(
        f"the request body has more than {limit} bytes; this server accepts at most {limit} (--max-message-bytes)",
        limit=limit,
    )


def _describe(catalog: AdapterCatalog, adapter_id: str) -> dict[str, Any]:
    """An adapter card's ``loraplex`` object (an extension field: OpenAI clients keep unknown keys): its kind as
    ListAdapters names it (``lora``, ``medusa``, ``medusa_lora``), whether its LoRA uses DoRA, the modules it
    replaces (``saved_modules``) and where it is."""
    lora, medusa = catalog.kind(LoraPart), catalog.kind(MedusaPart)
    info = lora.store.get(adapter_id) if lora is not None and lora.has(adapter_id) else None
    heads = medusa is not None and medusa.has(adapter_id)
    kind = ("medusa_" if heads else "") + ("lora" if info is not None else "")
    usage = medusa.usage(adapter_id) if medusa is not None and heads else None
    device = (info.device_bytes if info is not None else 0) + (usage.device_bytes if usage is not None else 0)
    host = info.host_bytes if info is not None else 0
    return {
        "kind": kind.rstrip("_"),
        "dora": info is not None and info.dora,
        "saved_modules": list(info.saved_modules) if info is not None else [],
        "tier": "device" if device else "host" if host else "disk",
    }


def _error(exc: BaseException, *, chat: bool, request_id: str, model: str | None = None) -> JSONResponse:
    """The error reply, with the call's id in ``x-request-id`` (a valid id: an invalid header's is never echoed)."""
    body = errors.error_body(exc, chat=chat, model=model)
    headers = {**errors.headers_of(exc), REQUEST_ID_HEADER: request_id}
    return JSONResponse(body, status_code=errors.http_status(exc), headers=headers)


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's error shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = f"{request.method} {request.url.path}: {exc.detail if isinstance(exc, HTTPException) else exc}"
    kind = "not_found" if status == 404 else "method_not_allowed" if status == 405 else "invalid_request"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": kind}}
    return JSONResponse(body, status_code=status)
