"""The server's interceptor chain: every cross-cutting RPC concern, one interceptor each, so servicers stay thin.

In ``grpc.aio.server(interceptors=chain(...))`` order, outermost first:

0. ``AccessInterceptor`` (``service.api.access``) — the request id (response metadata, every log line of the
   call) and the call observer (``service.frontend.observer``, shared with the HTTP API): one report per finished
   call of the loraplex services, refused ones included — ``loraplex_requests_total``,
   ``loraplex_adapter_requests_total`` for the generation RPCs, and the access line.
1. ``AuthInterceptor`` — API-key roles. A refused caller never has its request bytes parsed.
2. ``TransportInterceptor`` — safe request decoding (a ``DecodeError`` becomes INVALID_ARGUMENT, one warning line,
   instead of UNKNOWN with a traceback inside grpc) and streamed writes (``_write_stream``: a call ending while a
   reply is being sent counts as the deadline or cancellation it is, not as a grpc ERROR).
3. ``StatusInterceptor`` — typed errors -> rich statuses (``service.api.status``) for the loraplex services
   (health and reflection are left as they are).

Invariants: every wrapped handler keeps its method's (de)serializers and kind; all but ``AuthInterceptor`` and
``AccessInterceptor`` wrap a method's handler once and reuse it (grpc returns the same registered handler for a
method every time), which is why ``AuthInterceptor``'s per-call refusals must stay outside them, and the access
interceptor, which reports those refusals too, outside it (wrapping per call). Reader/writer handlers (health's
Watch) and request-streaming ones (reflection) pass through 2-3 as they are.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError

from service.api import access, status
from service.api.access import AccessInterceptor
from service.api.auth import KeyRing
from service.api.status import Context
from service.errors import LoraplexError, MalformedRequest

log = logging.getLogger("loraplex.api")

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic only in the type stubs
Continuation: TypeAlias = Callable[[grpc.HandlerCallDetails], Awaitable["Handler | None"]]
Around: TypeAlias = Callable[[Any, Context], contextlib.AbstractAsyncContextManager[None]]


def method_name(method: str) -> str:
    """``/loraplex.v1.Generation/Generate`` -> ``Generate`` (the ``method`` label)."""
    return method.rpartition("/")[2]


def _method_of(details: grpc.HandlerCallDetails) -> str:
    method: str = details.method  # type: ignore[attr-defined]  # aio's details carry it
    return method


def chain(keys: KeyRing, *, services: tuple[str, ...], known_adapter: Callable[[str], bool]) -> list[Any]:
    """The server's interceptors in order: ``services`` get error mapping and call reports, ``known_adapter``
    says whether an id may take one of the per-adapter label's slots."""
    return [
        AccessInterceptor(services, known_adapter),
        AuthInterceptor(keys),
        TransportInterceptor(),
        StatusInterceptor(services),
    ]


class _PerMethod(grpc.aio.ServerInterceptor):
    """An interceptor that wraps each method's handler once (``wrap``), or leaves it as it is."""

    def __init__(self) -> None:
        self._wrapped: dict[str, Handler] = {}

    @abc.abstractmethod
    def wrap(self, handler: Handler, method: str) -> Handler:
        """The handler that serves ``method`` through this interceptor."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED
            return None
        method = _method_of(handler_call_details)
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            wrapped = self._wrapped[method] = self.wrap(handler, method)
        return wrapped


def _around(handler: Handler, around: Around) -> Handler:
    """``handler`` with every call run inside ``around(request, context)`` (unary-request methods whose streamed
    replies come from an async generator; others are returned as they are)."""
    if handler.request_streaming:
        return handler
    if handler.response_streaming:
        inner_stream: Any = handler.unary_stream  # grpc's stubs type it for the sync server
        if not inspect.isasyncgenfunction(inner_stream):
            return handler

        async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
            async with around(request, context), contextlib.aclosing(inner_stream(request, context)) as replies:
                async for reply in replies:
                    yield reply

        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)
    inner_unary: Any = handler.unary_unary

    async def unary(request: Any, context: Context) -> Any:
        async with around(request, context):
            return await inner_unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)


# ------------------------------------------------------------------------------------------------------ 1. auth


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authorize by API-key role; a refused call is answered by ``_refusal`` without parsing its request."""

    def __init__(self, keys: KeyRing) -> None:
        self.keys = keys

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = _method_of(handler_call_details)
        try:
            self.keys.authorize(method, handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
        except LoraplexError as exc:
            return _refusal(handler, method_name(method), exc)
        return handler


def _refusal(handler: Handler, method: str, exc: LoraplexError) -> Handler:
    """A handler of ``handler``'s kind that answers ``exc``'s status without parsing the request."""

    async def unary(request: Any, context: Context) -> None:
        await status.abort(context, method, exc)

    async def stream(request: Any, context: Context) -> AsyncIterator[None]:
        await status.abort(context, method, exc)
        yield None  # pragma: no cover  (abort raises; the yield makes this an async generator)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


# -------------------------------------------------------------------------------------------------- 2. transport


class _Malformed:
    """What a wrapped deserializer returns for bytes that do not parse."""

    __slots__ = ("error", "size")

    def __init__(self, error: DecodeError, size: int) -> None:
        self.error = error
        self.size = size


def _decoder(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as exc:
            return _Malformed(exc, len(raw))

    return decode


async def _refuse_malformed(method: str, request: _Malformed, context: Context) -> None:
    log.warning("event=malformed_request method=%s bytes=%d error=%s", method, request.size, request.error)
    error = MalformedRequest(
        "the request is not a valid protobuf message for this method (corrupt bytes, or a string field that is "
        "not UTF-8)"
    )
    await status.abort(context, method_name(method), error)


class TransportInterceptor(_PerMethod):
    """Requests decoded safely, streamed replies written by ``_write_stream`` (unary-request methods; streamed
    requests are left as they are: only reflection has them, and it parses its own messages)."""

    def wrap(self, handler: Handler, method: str) -> Handler:
        if handler.request_streaming:
            return handler
        decode = _decoder(handler.request_deserializer)
        if handler.response_streaming:
            inner_stream: Any = handler.unary_stream
            writes_itself = not inspect.isasyncgenfunction(inner_stream)  # a reader/writer handler (health's Watch)

            async def stream(request: Any, context: Context) -> None:
                if isinstance(request, _Malformed):
                    await _refuse_malformed(method, request, context)
                if writes_itself:
                    await inner_stream(request, context)
                else:
                    await _write_stream(inner_stream(request, context), context)

            return grpc.unary_stream_rpc_method_handler(stream, decode, handler.response_serializer)
        inner_unary: Any = handler.unary_unary

        async def unary(request: Any, context: Context) -> Any:
            if isinstance(request, _Malformed):
                await _refuse_malformed(method, request, context)
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, decode, handler.response_serializer)


async def _write_stream(responses: AsyncGenerator[Any, None], context: Context) -> None:
    """Write each reply of a servicer's generator, as grpc would, except when the call ends while a reply is on its
    way (the deadline passed, the client went away): grpc would log that as an ERROR traceback, or cancel this task
    mid-send, and close the generator later, unseen. Here the generator is cancelled at its ``yield``, as grpc
    cancels a waiting handler, so the call is counted (DEADLINE_EXCEEDED / CANCELLED) and frees its engine slot at
    once."""
    first = True
    try:
        async for item in responses:
            try:
                if first:
                    await access.send_request_id(context)  # headers with the first reply: see there why
                    first = False
                await context.write(item)
            except (grpc.aio.InternalError, asyncio.CancelledError):  # a failed send batch, or cancelled mid-send
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await responses.athrow(asyncio.CancelledError())
                raise asyncio.CancelledError from None
    finally:
        await responses.aclose()


# ---------------------------------------------------------------------------------------------------- 3. status


class StatusInterceptor(_PerMethod):
    """Typed errors -> rich statuses for every call of ``services``' methods (the call observer counts them).

    A ``LoraplexError`` becomes its class's status with its message and ``ErrorInfo``; anything else is a bug,
    logged with its traceback and reported as INTERNAL."""

    def __init__(self, services: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = tuple(f"/{service}/" for service in services)

    def wrap(self, handler: Handler, method: str) -> Handler:
        if not method.startswith(self.prefixes):
            return handler
        name = method_name(method)

        @contextlib.asynccontextmanager
        async def mapped(request: Any, context: Context) -> AsyncIterator[None]:
            try:
                yield
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await status.abort(context, name, exc)

        return _around(handler, mapped)
