"""Rich gRPC statuses: a typed error becomes a status code, its message and a ``google.rpc.ErrorInfo`` detail.

The detail travels as ``google.rpc.Status`` in the ``grpc-status-details-bin`` trailer (built by grpcio-status's
``rpc_status.to_status``), so a client reads ``reason`` (``ADAPTER_NOT_FOUND``, ``INVALID_REQUEST``, ...), domain
``loraplex`` and the error's fields (``field``, ``adapter_id``, ``file``, ``tensor``, ``limit``) without parsing
the message. Every error status the server produces is built and sent by ``abort``, which tells the call observer
(``service.frontend.observer``) the code it sent; the error class decides the code. An exception that is not a
``LoraplexError`` is a bug: INTERNAL, with its traceback logged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeAlias

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from service.errors import DOMAIN, LoraplexError
from service.frontend import observer
from service.logs import REQUEST_ID, REQUEST_ID_HEADER

log = logging.getLogger("loraplex.api")

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

INTERNAL_REASON = "INTERNAL"
"""``ErrorInfo.reason`` of an exception that is not a ``LoraplexError`` (a bug)."""


def rich_status(
    code: grpc.StatusCode, message: str, reason: str, metadata: dict[str, str] | None = None
) -> grpc.Status:
    """A status with ``code`` and ``message`` whose trailing metadata carries one ``ErrorInfo``."""
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata or {}))
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    result: grpc.Status = rpc_status.to_status(status)
    return result


def of_error(exc: LoraplexError) -> grpc.Status:
    """The status of a typed error: its class's code, its message, its reason and structured fields."""
    return rich_status(grpc.StatusCode[exc.status], str(exc), exc.reason, exc.details())


def of_bug(exc: BaseException) -> grpc.Status:
    """INTERNAL for an exception that is not a ``LoraplexError``, naming only its type (the traceback is logged)."""
    message = f"internal error ({type(exc).__name__}); see the server log"
    return rich_status(grpc.StatusCode.INTERNAL, message, INTERNAL_REASON, {"exception": type(exc).__name__})


DEADLINE_SLACK_SECONDS = 0.05
"""A client's own deadline fires first, so its cancel reaches the server a moment before the server's copy of the
deadline (received as a relative timeout) passes: a cancel this close to the deadline is the deadline."""


def cancelled_code(context: Context) -> str:
    """Why a call was cancelled: its deadline passed (DEADLINE_EXCEEDED), or the client went away (CANCELLED)."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_SECONDS else "CANCELLED"


def code_of(exc: BaseException, context: Context) -> str:
    """The status code name an exception ends its call with (cancellation included)."""
    if isinstance(exc, LoraplexError):
        return exc.status
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return cancelled_code(context)
    return "INTERNAL"


async def abort(context: Context, method: str, exc: BaseException) -> None:
    """End the call with ``exc``'s rich status, reported as the call's code (``observer.decided``). Always raises.

    The call's request id (``service.logs.REQUEST_ID``), when there is one, goes in the trailers beside the
    details (``x-request-id``); ``ErrorInfo.metadata`` keeps only the error's own fields."""
    request_id = REQUEST_ID.get()
    if isinstance(exc, LoraplexError):
        status = of_error(exc)
    else:
        log.exception("bug in %s", method, exc_info=exc)
        status = of_bug(exc)
    observer.decided(method, status.code.name)
    trailers = tuple(status.trailing_metadata)
    if request_id is not None:
        trailers = (*trailers, (REQUEST_ID_HEADER, request_id))
    try:
        await context.abort(status.code, status.details, trailers)
    except grpc.aio.InternalError:
        # The call ended while the status was being sent (its deadline passed in the core a moment after ours,
        # or the client left): nothing can reach the client any more. Reported above; leave as a cancelled call,
        # which gRPC closes quietly, rather than as an error gRPC logs with a traceback.
        raise asyncio.CancelledError from None
