"""The server interceptor, in front of every registered RPC: API-key roles, safe request decoding, streamed writes.

grpc deserializes a request before any servicer code runs, so a malformed message (corrupt wire format, a string
field that is not UTF-8) would end as UNKNOWN with an ERROR traceback inside grpc. Here every request deserializer
is wrapped: a ``DecodeError`` becomes a marker value that the wrapped method turns into INVALID_ARGUMENT, logged as
one warning line. A caller refused by ``KeyRing.authorize`` never has its request bytes parsed.

Streamed replies are written here (``_write_stream``) so that a call ending while a reply is being sent counts as
the deadline or cancellation it is, not as a grpc ERROR. Statuses produced here are counted in
``loraplex_requests_total`` like those of ``service.api.edge``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError

from service import metrics
from service.api.auth import KeyRing
from service.errors import LoraplexError

log = logging.getLogger("loraplex.api")

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic only in the type stubs
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class _Malformed:
    """What a wrapped deserializer returns for bytes that do not parse."""

    __slots__ = ("error", "size")

    def __init__(self, error: DecodeError, size: int) -> None:
        self.error = error
        self.size = size


def _method_name(method: str) -> str:
    return method.rpartition("/")[2]


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
    metrics.REQUESTS.labels(_method_name(method), grpc.StatusCode.INVALID_ARGUMENT.name).inc()
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        "the request is not a valid protobuf message for this method (corrupt bytes, or a string field that is "
        "not UTF-8)",
    )


def _guarded(handler: Handler, method: str) -> Handler:
    """``handler`` with its request deserializer wrapped, and its streamed replies written by ``_write_stream``
    (unary-request methods; streamed requests are left as they are: only reflection has them, and it parses its own
    messages)."""
    if handler.request_streaming:
        return handler
    decode = _decoder(handler.request_deserializer)
    if handler.response_streaming:
        inner_stream: Any = handler.unary_stream  # grpc's stubs type it for the sync server
        if not inspect.isasyncgenfunction(inner_stream):  # a reader/writer handler (health's Watch) writes itself

            async def writer(request: Any, context: Context) -> None:
                if isinstance(request, _Malformed):
                    await _refuse_malformed(method, request, context)
                await inner_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(writer, decode, handler.response_serializer)

        async def stream(request: Any, context: Context) -> None:
            if isinstance(request, _Malformed):
                await _refuse_malformed(method, request, context)
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
    cancels a waiting handler, so the edge counts the call (DEADLINE_EXCEEDED / CANCELLED) and frees its engine slot
    at once."""
    try:
        async for item in responses:
            try:
                await context.write(item)
            except (grpc.aio.InternalError, asyncio.CancelledError):  # a failed send batch, or cancelled mid-send
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await responses.athrow(asyncio.CancelledError())
                raise asyncio.CancelledError from None
    finally:
        await responses.aclose()


def _refusal(handler: Handler, code: grpc.StatusCode, message: str) -> Handler:
    """A handler of ``handler``'s kind that answers ``code`` without parsing the request."""

    async def unary(request: Any, context: Context) -> None:
        await context.abort(code, message)

    async def stream(request: Any, context: Context) -> AsyncIterator[None]:
        await context.abort(code, message)
        yield None  # pragma: no cover  (abort raises; the yield makes this an async generator)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    """Authorize by API-key role, then serve through ``_guarded``. Wrapped handlers are made once per method (grpc
    returns the same registered handler for a method every time)."""

    def __init__(self, keys: KeyRing) -> None:
        self.keys = keys
        self._wrapped: dict[str, Handler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED
            return None
        method: str = handler_call_details.method  # type: ignore[attr-defined]  # aio's details carry it
        try:
            self.keys.authorize(method, handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
        except LoraplexError as exc:
            code = grpc.StatusCode[exc.status]
            metrics.REQUESTS.labels(_method_name(method), code.name).inc()
            return _refusal(handler, code, str(exc))
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            wrapped = self._wrapped[method] = _guarded(handler, method)
        return wrapped
