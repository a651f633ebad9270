"""Log set-up of `loraplex serve`: one event per line, as key=value text or JSON, each tagged with its request id.

``REQUEST_ID`` is the id of the request whose code is running (set by the call observer,
``service.frontend.observer``, for the whole of each call of either API); ``RequestIdFilter`` copies it onto
every record, so any line logged while serving a request names it, whichever logger wrote it. Structured fields
travel as ``extra={"fields": {...}}``: text lines append them as ``key=value``, JSON lines as top-level keys. Code that
runs outside the request's context (the engine thread) names the request itself: ``extra=about(request_id)``.

Text: ``ts=... level=INFO logger=loraplex.access request_id=... <message> <fields>``. JSON: one object per line
with the stable keys ``ts, level, logger, request_id, message`` (request_id null outside a request), then the
fields, then ``exception`` when a traceback is logged. Nothing here runs at import; ``configure`` is called by
the entry point.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import threading
import time
import uuid
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

REQUEST_ID_HEADER = "x-request-id"
"""Request metadata a client may send its request id in, and response metadata (initial and trailing) the server
returns it in."""

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("loraplex_request_id", default=None)


def new_request_id() -> str:
    return uuid.uuid4().hex


def about(request_id: str) -> dict[str, Any]:
    """``extra=`` for a line about request ``request_id`` logged outside that request's context: on the engine
    thread, where ``REQUEST_ID`` is unset (context variables do not cross threads)."""
    return {"request_id": request_id}


class RequestIdFilter(logging.Filter):
    """Tags each record with ``REQUEST_ID`` of the context that logged it (unless the call named one itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


def timestamp(record: logging.LogRecord) -> str:
    """The record's time in UTC, ISO 8601 with milliseconds: ``2026-01-31T12:00:00.123Z``."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


def _text_value(value: Any) -> str:
    text = "" if value is None else str(value)
    if text and not any(c.isspace() or c in '"=' for c in text):
        return text
    return json.dumps(text)


class TextFormatter(logging.Formatter):
    """``ts=<UTC, ISO 8601> level=... logger=... [request_id=...] message [key=value ...]``."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        parts = [f"ts={timestamp(record)} level={record.levelname} logger={record.name}"]
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            parts.append(f"request_id={_text_value(request_id)}")
        parts.append(record.message)
        parts.extend(f"{key}={_text_value(value)}" for key, value in _fields(record).items())
        return " ".join(part for part in parts if part)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601, ms), ``level``, ``logger``, ``request_id``, ``message``,
    the record's fields, and ``exception`` (the formatted traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", None),
            "message": record.getMessage(),
        }
        for key, value in _fields(record).items():
            line.setdefault(key, value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def handler(log_format: str, stream: TextIO | None = None) -> logging.Handler:
    """A stream handler (default stderr) writing ``log_format`` lines, with the request-id filter."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")
    result = logging.StreamHandler(sys.stderr if stream is None else stream)
    result.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    result.addFilter(RequestIdFilter())
    return result


def configure(log_format: str, log_level: str, stream: TextIO | None = None) -> logging.Handler:
    """Make ``handler(log_format, stream)`` the root logger's only handler, at ``log_level``; returns it.
    Python warnings (a library's deprecation notice) become records of ``py.warnings`` too, and an exception
    that ends a thread an ERROR record of ``loraplex.threads`` with its traceback, so a JSON log stays one object
    per line."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    new = handler(log_format, stream)
    root.addHandler(new)
    root.setLevel(log_level.upper())
    logging.captureWarnings(True)
    threading.excepthook = log_thread_exception
    return new


def log_thread_exception(args: threading.ExceptHookArgs) -> None:
    """``threading.excepthook``: the exception that ended a thread, as one record (not raw text on stderr)."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else None
    logging.getLogger("loraplex.threads").error(
        "event=thread_crashed thread=%s error=%s", name, args.exc_type.__name__, exc_info=args.exc_value
    )
