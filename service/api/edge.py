"""The API edge: typed errors -> gRPC status codes and per-RPC metrics, in one place.

Every servicer method is wrapped by ``unary`` or ``streaming``. A ``LoraplexError`` becomes its class's status
with its message; anything else is a bug, logged with its traceback and reported as INTERNAL. A call cancelled
because its deadline passed is counted as DEADLINE_EXCEEDED, any other cancellation as CANCELLED.
API keys and request decoding are checked before this, by ``service.api.interceptors``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from service import metrics
from service.errors import LoraplexError

log = logging.getLogger("loraplex.api")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Servicer = Any
Context = grpc.aio.ServicerContext[Any, Any]


DEADLINE_SLACK_SECONDS = 0.05
"""A client's own deadline fires first, so its cancel reaches the server a moment before the server's copy of the
deadline (received as a relative timeout) passes: a cancel this close to the deadline is the deadline."""


def _cancelled_code(context: Context) -> str:
    """Why a call was cancelled: its deadline passed (DEADLINE_EXCEEDED), or the client went away (CANCELLED)."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_SECONDS else "CANCELLED"


async def _abort(context: Context, method: str, exc: BaseException) -> None:
    if isinstance(exc, LoraplexError):
        code = grpc.StatusCode[exc.status]
        message = str(exc)
    else:
        log.exception("bug in %s", method, exc_info=exc)
        code = grpc.StatusCode.INTERNAL
        message = f"internal error ({type(exc).__name__}); see the server log"
    metrics.REQUESTS.labels(method, code.name).inc()
    await context.abort(code, message)


def unary(
    method: str,
) -> Callable[
    [Callable[[Servicer, Req, Context], Awaitable[Resp]]],
    Callable[[Servicer, Req, Context], Awaitable[Resp]],
]:
    def wrap(
        fn: Callable[[Servicer, Req, Context], Awaitable[Resp]],
    ) -> Callable[[Servicer, Req, Context], Awaitable[Resp]]:
        @functools.wraps(fn)
        async def handler(self: Servicer, request: Req, context: Context) -> Resp:
            try:
                response = await fn(self, request, context)
            except asyncio.CancelledError:
                metrics.REQUESTS.labels(method, _cancelled_code(context)).inc()
                raise
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await _abort(context, method, exc)
                raise  # unreachable: abort raises
            metrics.REQUESTS.labels(method, "OK").inc()
            return response

        return handler

    return wrap


def streaming(
    method: str,
) -> Callable[
    [Callable[[Servicer, Req, Context], AsyncIterator[Resp]]],
    Callable[[Servicer, Req, Context], AsyncIterator[Resp]],
]:
    def wrap(
        fn: Callable[[Servicer, Req, Context], AsyncIterator[Resp]],
    ) -> Callable[[Servicer, Req, Context], AsyncIterator[Resp]]:
        @functools.wraps(fn)
        async def handler(self: Servicer, request: Req, context: Context) -> AsyncIterator[Resp]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except asyncio.CancelledError:
                metrics.REQUESTS.labels(method, _cancelled_code(context)).inc()
                raise
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await _abort(context, method, exc)
            else:
                metrics.REQUESTS.labels(method, "OK").inc()

        return handler

    return wrap
