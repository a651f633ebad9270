"""Request ids and the access log: one INFO line on ``loraplex.access`` per finished loraplex RPC.

``AccessInterceptor`` is the outermost interceptor (so refusals by the auth interceptor are logged too). For each
call of the loraplex services it picks the request id — the request's ``request_id`` field, else the
``x-request-id`` metadata, else a new uuid4 hex — and, for the whole call, sets ``service.logs.REQUEST_ID``
(every log line of the call names it) and ``CURRENT``, the call's ``Access`` record, which the generation
servicer fills in (``submitted`` / ``observe``: prompt and generated tokens, time to first token). The id goes
back in the trailing response metadata (``x-request-id``), and in the initial metadata with the first reply
(``send_request_id``); ``service.api.status.abort`` adds it to
error trailers and ``ErrorInfo.metadata``. A request whose ``request_id`` field is empty gets the chosen id
written into it, so the servicer echoes the same id; an invalid one is left for the servicer to refuse (the
access line then shows a new id, never the invalid text). A call the auth interceptor refuses is never parsed,
so its id is the header's (or a new one).

The line: ``event=access method adapter code prompt_tokens generated_tokens ttft_seconds duration_seconds peer``
(``ttft_seconds`` empty when no token was generated; ``peer`` as gRPC writes it, ``ipv4:host:port``, for HTTP calls
too). Health and reflection calls are not logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import Message

from service.api import convert, status
from service.api.status import Context
from service.engine.request import TokenEvent
from service.logs import REQUEST_ID, REQUEST_ID_HEADER, new_request_id

log = logging.getLogger("loraplex.access")

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Continuation: TypeAlias = Callable[[grpc.HandlerCallDetails], Awaitable["Handler | None"]]

ADMIN_PREFIX = "/loraplex.v1.Adapters/"


@dataclass
class Access:
    """What the access line of one call reports; the servicer adds tokens and the first token's time."""

    request_id: str
    method: str
    adapter: str
    peer: str
    started: float  # time.monotonic()
    prompt_tokens: int = 0
    generated_tokens: int = 0
    first_token: float | None = None

    def fields(self, code: str, now: float) -> dict[str, Any]:
        ttft = None if self.first_token is None else round(self.first_token - self.started, 6)
        return {
            "method": self.method,
            "adapter": self.adapter,
            "code": code,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_seconds": ttft,
            "duration_seconds": round(now - self.started, 6),
            "peer": self.peer,
        }


CURRENT: contextvars.ContextVar[Access | None] = contextvars.ContextVar("loraplex_access", default=None)


def peer_of(host: str, port: int) -> str:
    """An HTTP client's address written as gRPC writes a peer (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``), so access
    lines of both APIs can be read and queried alike."""
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def submitted(prompt_tokens: int) -> None:
    """A prompt of the current call went to the engine."""
    record = CURRENT.get()
    if record is not None:
        record.prompt_tokens += prompt_tokens


def observe(event: TokenEvent) -> None:
    """An engine event of the current call reached the servicer."""
    record = CURRENT.get()
    if record is None or not event.token_ids:
        return
    if record.first_token is None:
        record.first_token = time.monotonic()
    record.generated_tokens += len(event.token_ids)


def request_id_for(request: object, metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The call's request id (see the module docstring); fills an empty ``request_id`` field with it."""
    has_field = isinstance(request, Message) and "request_id" in request.DESCRIPTOR.fields_by_name
    given: str = getattr(request, "request_id", "") if has_field else ""
    if given:
        return given if convert.is_request_id(given) else new_request_id()
    header = next((v for k, v in metadata or () if k == REQUEST_ID_HEADER and isinstance(v, str)), "")
    chosen = header if convert.is_request_id(header) else new_request_id()
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
    """Request ids and access lines for the methods of ``services`` (the outermost interceptor)."""

    def __init__(self, services: tuple[str, ...]) -> None:
        self.prefixes = tuple(f"/{service}/" for service in services)

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or handler.request_streaming or not method.startswith(self.prefixes):
            return handler
        # Wrapped per call: inside, the auth interceptor answers some calls with a refusal handler of their own.
        return _wrap(handler, method)


def _wrap(handler: Handler, method: str) -> Handler:
    name = method.rpartition("/")[2]
    if handler.response_streaming:
        inner_stream: Any = handler.unary_stream

        async def stream(request: Any, context: Context) -> None:
            async with _tracked(request, context, method, name):
                if inspect.isasyncgenfunction(inner_stream):  # a refusal: it raises before its first reply
                    async for reply in inner_stream(request, context):
                        await context.write(reply)
                else:
                    await inner_stream(request, context)

        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)
    inner_unary: Any = handler.unary_unary

    async def unary(request: Any, context: Context) -> Any:
        async with _tracked(request, context, method, name):
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
async def _tracked(request: Any, context: Context, method: str, name: str) -> AsyncIterator[None]:
    request_id = request_id_for(request, context.invocation_metadata())
    record = Access(request_id, name, _adapter_of(request, method), context.peer(), time.monotonic())
    id_token, record_token = REQUEST_ID.set(request_id), CURRENT.set(record)
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
        log.info("event=access", extra={"fields": record.fields(code, time.monotonic())})
        CURRENT.reset(record_token)
        REQUEST_ID.reset(id_token)
