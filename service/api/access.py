"""The gRPC edge of the call observer (``service.frontend.observer``): request ids and one report per call.

``AccessInterceptor`` is the outermost interceptor (so refusals by the auth interceptor are reported too). For each
call of the loraplex services it picks the request id — the request's ``request_id`` field, else the
``x-request-id`` metadata, else a new uuid4 hex — and ``begin`` s the call's ``ObservedCall`` for the whole call
(every log line names the id; the frontend counts the call's tokens into it). When the call ends the observer
reports it, once, with the code the call ended with: ``loraplex_requests_total``, for a parsed generation request
``loraplex_adapter_requests_total``, and the access line (its ``adapter``: a generation request's ``adapter_id``, an
admin request's ``id``). The id goes back in the trailing response metadata (``x-request-id``), and in the initial
metadata with the first reply (``send_request_id``); ``service.api.status.abort`` adds it to error trailers and
``ErrorInfo.metadata``. A request whose ``request_id`` field is empty gets the chosen id written into it, so the
servicer echoes the same id; an invalid one is left for the frontend to refuse (the access line then shows a new
id, never the invalid text). A call the auth interceptor refuses is never parsed, so its id is the header's (or a
new one). Health and reflection calls are not observed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import Message

from service.api import status
from service.api.status import Context
from service.frontend import checks, observer
from service.logs import REQUEST_ID, REQUEST_ID_HEADER, new_request_id

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Continuation: TypeAlias = Callable[[grpc.HandlerCallDetails], Awaitable["Handler | None"]]

ADMIN_PREFIX = "/loraplex.v1.Adapters/"


GENERATION_METHODS = frozenset({"/loraplex.v1.Generation/Generate", "/loraplex.v1.Generation/GenerateStream"})
"""The RPCs whose request names an adapter (``adapter_id``), counted per adapter."""


def request_id_for(request: object, metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The call's request id (see the module docstring); fills an empty ``request_id`` field with it."""
    has_field = isinstance(request, Message) and "request_id" in request.DESCRIPTOR.fields_by_name
    given: str = getattr(request, "request_id", "") if has_field else ""
    if given:
        return given if checks.is_request_id(given) else new_request_id()
    header = next((v for k, v in metadata or () if k == REQUEST_ID_HEADER and isinstance(v, str)), "")
    chosen = header if checks.is_request_id(header) else new_request_id()
    if has_field:
        request.request_id = chosen  # type: ignore[attr-defined]
    return chosen


def _adapter_of(request: object, method: str) -> str:
    """The adapter a call is about: a generation request's ``adapter_id``, an admin request's ``id``."""
    if not isinstance(request, Message):  # bytes that did not parse
        return ""
    fields = request.DESCRIPTOR.fields_by_name
    name = "adapter_id" if "adapter_id" in fields else "id" if method.startswith(ADMIN_PREFIX) else ""
    return str(getattr(request, name)) if name in fields else ""


def _code_name(context: Context) -> str:
    code: Any = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    by_value = {c.value[0]: c.name for c in grpc.StatusCode}
    return by_value.get(code, "UNKNOWN") if isinstance(code, int) else "UNKNOWN"


class AccessInterceptor(grpc.aio.ServerInterceptor):
    """Request ids and call reports for the methods of ``services`` (the outermost interceptor); ``known_adapter``
    says whether an id may take one of the per-adapter label's slots."""

    def __init__(self, services: tuple[str, ...], known_adapter: Callable[[str], bool]) -> None:
        self.prefixes = tuple(f"/{service}/" for service in services)
        self.known_adapter = known_adapter

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or handler.request_streaming or not method.startswith(self.prefixes):
            return handler
        # Wrapped per call: inside, the auth interceptor answers some calls with a refusal handler of their own.
        return _wrap(handler, method, self.known_adapter)


def _wrap(handler: Handler, method: str, known: Callable[[str], bool]) -> Handler:
    if handler.response_streaming:
        inner_stream: Any = handler.unary_stream

        async def stream(request: Any, context: Context) -> None:
            async with _tracked(request, context, method, known):
                if inspect.isasyncgenfunction(inner_stream):  # a refusal: it raises before its first reply
                    async for reply in inner_stream(request, context):
                        await context.write(reply)
                else:
                    await inner_stream(request, context)

        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)
    inner_unary: Any = handler.unary_unary

    async def unary(request: Any, context: Context) -> Any:
        async with _tracked(request, context, method, known):
            reply = await inner_unary(request, context)
            await send_request_id(context)
            return reply

    return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)


async def send_request_id(context: Context) -> None:
    """The call's id as initial metadata: sent with the first reply, never before. An error before any reply
    then leaves the call uncommitted (a trailers-only response), which is what lets a client's retry policy
    retry it (gRPC retries only calls that received no response headers)."""
    request_id = REQUEST_ID.get()
    if request_id is None:
        return
    try:
        await context.send_initial_metadata(((REQUEST_ID_HEADER, request_id),))
    except grpc.aio.InternalError:  # the call ended meanwhile (deadline, client gone): count it as cancelled
        raise asyncio.CancelledError from None


@contextlib.asynccontextmanager
async def _tracked(request: Any, context: Context, method: str, known: Callable[[str], bool]) -> AsyncIterator[None]:
    request_id = request_id_for(request, context.invocation_metadata())
    call = observer.begin(method.rpartition("/")[2], request_id, context.peer(), known)
    call.adapter = _adapter_of(request, method)
    call.per_adapter = method in GENERATION_METHODS and isinstance(request, Message)  # parsed, not refused by auth
    code = "OK"
    try:
        context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id),))
        yield
    except asyncio.CancelledError:
        code = status.cancelled_code(context)
        raise
    except grpc.aio.AbortError:
        code = _code_name(context)
        raise
    except BaseException as exc:
        code = status.code_of(exc, context)
        raise
    finally:
        call.finish(code)
        call.end()
