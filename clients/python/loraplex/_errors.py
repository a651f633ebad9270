"""Errors raised by the client: one class per gRPC status a caller can act on.

    LoraplexError(code, message, details)   any failed RPC; ``.code`` is the grpc.StatusCode, ``.reason`` and
    │                                       ``.details`` the server's google.rpc.ErrorInfo
    ├── InvalidArgument       INVALID_ARGUMENT     bad parameters, prompt too long, invalid adapter files
    ├── NotFound              NOT_FOUND            unknown adapter id, missing adapter path
    ├── AlreadyExists         ALREADY_EXISTS       adapter id taken
    ├── FailedPrecondition    FAILED_PRECONDITION  e.g. adapter built for another base model
    ├── ResourceExhausted     RESOURCE_EXHAUSTED   queue full: retry later
    ├── Unavailable           UNAVAILABLE          server loading, draining or unreachable: retry
    ├── DeadlineExceeded      DEADLINE_EXCEEDED    the call's timeout passed
    ├── Unauthenticated       UNAUTHENTICATED      missing or unknown API key
    ├── PermissionDenied      PERMISSION_DENIED    key not allowed, adapter path outside allowed roots
    ├── Cancelled             CANCELLED            the call was cancelled
    ├── Unimplemented         UNIMPLEMENTED        the server does not have this RPC (older server)
    └── Internal              INTERNAL             a server bug

Other codes (UNKNOWN, ABORTED, OUT_OF_RANGE, DATA_LOSS) raise ``LoraplexError`` itself, with its code.
``from_rpc_error`` is the one place a ``grpc.RpcError`` becomes one of these; it reads the server's
``google.rpc.ErrorInfo`` from the ``grpc-status-details-bin`` trailer with googleapis-common-protos (no
grpcio-status needed). Arguments the client can reject before calling (a negative temperature, an empty
prompt list) raise ``ValueError`` / ``TypeError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"
"""Trailing metadata key of the serialized ``google.rpc.Status`` that carries the error details."""
REQUEST_ID_KEY = "x-request-id"
"""Trailing metadata key of the request id the server used in its logs."""


class LoraplexError(Exception):
    """A failed RPC.

    ``code`` is the grpc.StatusCode and ``message`` the server's status message. From the server's
    ``google.rpc.ErrorInfo``: ``reason`` (e.g. ``ADAPTER_NOT_FOUND``, ``INVALID_REQUEST``, ``QUEUE_FULL``;
    "" when the server sent none), ``domain`` ("loraplex") and ``details``, its metadata: the error's
    fields where it has them (``field``, ``limit``, ``adapter_id``, ``file``, ``tensor``), all ``str``.
    ``trailing_metadata``: the call's trailing metadata as sent (keys lower-case; values ``str``, or
    ``bytes`` for ``-bin`` keys); ``request_id`` the server's id of the request, from it.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        details: Mapping[str, str] | None = None,
        *,
        reason: str = "",
        domain: str = "",
        trailing_metadata: Mapping[str, str | bytes] | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}" if message else code.name)
        self.code = code
        self.message = message
        self.reason = reason
        self.domain = domain
        self.details: Mapping[str, str] = MappingProxyType(dict(details or {}))
        self.trailing_metadata: Mapping[str, str | bytes] = MappingProxyType(dict(trailing_metadata or {}))

    @property
    def request_id(self) -> str | None:
        """The server's id of the failed request (its ``x-request-id`` trailer), as in its log lines; None when
        the server sent none (an older server, or a failure before the server saw the call)."""
        value = self.trailing_metadata.get(REQUEST_ID_KEY)
        return value if isinstance(value, str) else None


class InvalidArgument(LoraplexError):
    """INVALID_ARGUMENT: the request (or the adapter files it names) cannot be served as given."""


class NotFound(LoraplexError):
    """NOT_FOUND: unknown adapter id, or no such adapter path on the server."""


class AlreadyExists(LoraplexError):
    """ALREADY_EXISTS: an adapter with that id is already registered."""


class FailedPrecondition(LoraplexError):
    """FAILED_PRECONDITION: the server is not in a state to do this (see the message)."""


class ResourceExhausted(LoraplexError):
    """RESOURCE_EXHAUSTED: the server's queue is full; retry later, with backoff."""


class Unavailable(LoraplexError):
    """UNAVAILABLE: the server is starting, draining or unreachable; safe to retry."""


class DeadlineExceeded(LoraplexError):
    """DEADLINE_EXCEEDED: the call's timeout passed before it finished."""


class Unauthenticated(LoraplexError):
    """UNAUTHENTICATED: the server needs an API key (``api_key=``) and got none or an unknown one."""


class PermissionDenied(LoraplexError):
    """PERMISSION_DENIED: the key may not do this, or the adapter path is outside the allowed roots."""


class Cancelled(LoraplexError):
    """CANCELLED: the call was cancelled (by this client or by the server shutting down)."""


class Unimplemented(LoraplexError):
    """UNIMPLEMENTED: the server does not provide this RPC (it is older than this client)."""


class Internal(LoraplexError):
    """INTERNAL: a bug in the server; the message says where."""


_BY_CODE: dict[grpc.StatusCode, type[LoraplexError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.INTERNAL: Internal,
}


def error_class(code: grpc.StatusCode) -> type[LoraplexError]:
    """The exception class for a status code (``LoraplexError`` for codes without their own)."""
    return _BY_CODE.get(code, LoraplexError)


def from_rpc_error(error: grpc.RpcError) -> LoraplexError:
    """Turn a failed call (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``) into a ``LoraplexError``.

    Both kinds of error are also ``grpc.Call``-like: they carry ``code()``, ``details()`` and
    ``trailing_metadata()``. An ``RpcError`` without them (it should not happen) becomes UNKNOWN.
    """
    code_fn = getattr(error, "code", None)
    code = code_fn() if callable(code_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details_fn = getattr(error, "details", None)
    message = details_fn() if callable(details_fn) else None
    trailing_fn = getattr(error, "trailing_metadata", None)
    trailing = trailing_fn() if callable(trailing_fn) else None
    metadata: dict[str, str | bytes] = {}
    for item in trailing or ():
        key, value = item[0], item[1]
        metadata[str(key)] = value if isinstance(value, bytes) else str(value)
    info = error_info(metadata.get(STATUS_DETAILS_KEY))
    return error_class(code)(
        code,
        message or "",
        dict(info.metadata) if info is not None else None,
        reason=info.reason if info is not None else "",
        domain=info.domain if info is not None else "",
        trailing_metadata=metadata,
    )


def error_info(status_details: str | bytes | None) -> error_details_pb2.ErrorInfo | None:
    """The first ``google.rpc.ErrorInfo`` in a serialized ``google.rpc.Status`` (None when there is none, or
    the bytes do not parse: a proxy's own status must not turn into a client crash)."""
    if not isinstance(status_details, bytes):
        return None
    try:
        status = status_pb2.Status.FromString(status_details)
    except DecodeError:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info
    return None
