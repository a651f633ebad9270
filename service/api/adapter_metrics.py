"""Per-adapter request outcomes: a decorator for the generation servicer's methods.

It sits inside the edge's ``unary`` / ``streaming`` wrapper, so it sees the typed error before the edge turns it
into a status, and records one ``loraplex_adapter_requests_total`` sample per RPC through ``metrics.ADAPTERS``
(which bounds the label). A client deadline that cancels the handler counts as DEADLINE_EXCEEDED, any other
cancellation as CANCELLED. It never changes what the RPC returns or raises.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc

from service import metrics
from service.errors import LoraplexError

Req = TypeVar("Req", bound="_HasAdapter")
Resp = TypeVar("Resp")
Context = grpc.aio.ServicerContext[Any, Any]


class _HasAdapter(Protocol):
    @property
    def adapter_id(self) -> str: ...


def _code(exc: BaseException, context: Context) -> str:
    if isinstance(exc, LoraplexError):
        return exc.status
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # the client went away or its deadline passed
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    return "INTERNAL"


def _known(servicer: Any, adapter_id: str) -> bool:
    """Whether ``adapter_id`` is registered now: only registered ids may take one of the label's slots."""
    loaded = servicer.runtime.loaded
    if not adapter_id or loaded is None:
        return False
    try:
        loaded.adapters.kind(adapter_id)
    except LoraplexError:
        return False
    return True


def _record(servicer: Any, request: _HasAdapter, code: str) -> None:
    metrics.ADAPTERS.request_finished(request.adapter_id, code, known=_known(servicer, request.adapter_id))


def by_adapter(
    fn: Callable[[Any, Req, Context], Awaitable[Resp]],
) -> Callable[[Any, Req, Context], Awaitable[Resp]]:
    @functools.wraps(fn)
    async def handler(self: Any, request: Req, context: Context) -> Resp:
        try:
            response = await fn(self, request, context)
        except BaseException as exc:
            _record(self, request, _code(exc, context))
            raise
        _record(self, request, "OK")
        return response

    return handler


def by_adapter_stream(
    fn: Callable[[Any, Req, Context], AsyncIterator[Resp]],
) -> Callable[[Any, Req, Context], AsyncIterator[Resp]]:
    @functools.wraps(fn)
    async def handler(self: Any, request: Req, context: Context) -> AsyncIterator[Resp]:
        try:
            async for item in fn(self, request, context):
                yield item
        except BaseException as exc:
            _record(self, request, _code(exc, context))
            raise
        _record(self, request, "OK")

    return handler
