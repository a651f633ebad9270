"""The one error tree (``service.errors``) as OpenAI error bodies and HTTP status codes.

Each ``LoraplexError`` class already knows its gRPC status; ``HTTP_STATUS`` turns that status into an HTTP code,
so the mapping of a new error class needs no change here. The body is OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``: ``code`` is the error's reason in lower snake case
(``queue_full``, ``invalid_request``), except for the names OpenAI clients look for (``model_not_found``,
``unsupported_parameter``, ``unknown_parameter``); ``param`` is the OpenAI name of the field at fault (``param_of``:
from the domain field an error of the shared checks names, never through protobuf).
Anything that is not a ``LoraplexError`` is a bug: 500, with its traceback logged and only its type sent.
"""

from __future__ import annotations

import logging
from typing import Any

from service.errors import AdapterNotFound, LoraplexError, echo

log = logging.getLogger("loraplex.http")

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
"""gRPC status name (``LoraplexError.status``) -> HTTP status code."""

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
}
"""HTTP status -> OpenAI's ``error.type`` (5xx: ``server_error``)."""

RETRY_AFTER_SECONDS = "1"
"""``Retry-After`` of a 429 (queue full) or 503 (loading, draining): a short wait, as the gRPC client's backoff."""

# Domain fields (``service.frontend.request``) -> the OpenAI parameter; first matching prefix wins. A field the
# HTTP edge named itself is already the OpenAI name and matches none of these.
_PARAMS = (
    ("max_new_tokens", "max_tokens"),
    ("stop_sequences", "stop"),
    ("sampling.", ""),
    ("inputs[", "@input"),
    ("input.", "@input"),
    ("inputs", "n"),
    ("adapter_id", "model"),
    ("request_id", "x-request-id"),
)


def param_of(field: str | None, *, chat: bool) -> str | None:
    """The OpenAI parameter an error's ``field`` is about (``sampling.top_p`` -> ``top_p``)."""
    if field is None:
        return None
    for prefix, name in _PARAMS:
        if field.startswith(prefix):
            if name == "":
                return field.removeprefix(prefix)
            if name == "@input":
                return "messages" if chat else "prompt"
            return name
    return field


def code_of(exc: LoraplexError) -> str:
    if isinstance(exc, AdapterNotFound):
        return "model_not_found"
    return exc.reason.lower()  # UNSUPPORTED_PARAMETER -> unsupported_parameter, QUEUE_FULL -> queue_full, ...


def http_status(exc: BaseException) -> int:
    return HTTP_STATUS.get(exc.status, 500) if isinstance(exc, LoraplexError) else 500


def status_name(exc: BaseException) -> str:
    """The gRPC status name an exception ends an HTTP call with: the ``code`` label of the request metrics."""
    return exc.status if isinstance(exc, LoraplexError) else "INTERNAL"


def error_body(exc: BaseException, *, chat: bool, where: str = "http", model: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for ``exc`` (a bug is logged here, with its traceback, once). ``model``: the call's
    ``model``, where it was parsed: an unknown adapter other than it is one of ``adapters`` (a mixture)."""
    if not isinstance(exc, LoraplexError):
        log.error("event=bug where=%s error=%s", where, type(exc).__name__, exc_info=exc)
        message = f"internal error ({type(exc).__name__}); see the server log"
        return {"error": {"message": message, "type": "server_error", "param": None, "code": "internal"}}
    status = http_status(exc)
    message = str(exc)
    if isinstance(exc, AdapterNotFound):
        message = (
            f"The model {echo(exc.adapter_id)} does not exist: GET /v1/models lists the base model and every "
            "registered adapter"
        )
    field = getattr(exc, "field", None)
    if isinstance(exc, AdapterNotFound):
        field = "model"
        if model is not None and exc.adapter_id != model:
            message = f"adapter {echo(exc.adapter_id)} of adapters does not exist: GET /v1/models lists every one"
            field = "adapters"
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param_of(field, chat=chat),
            "code": code_of(exc),
        }
    }


def headers_of(exc: BaseException) -> dict[str, str]:
    return {"retry-after": RETRY_AFTER_SECONDS} if http_status(exc) in (429, 503) else {}
