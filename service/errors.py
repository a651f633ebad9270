"""The one exception tree of loraplex.

Internal code raises these; the API edge (``service.api``) maps each to its gRPC status by the class's
``status`` attribute, so the mapping lives in one place and nothing below the servicer imports grpc.
An exception that is not a ``LoraplexError`` reaching the edge is a bug and becomes INTERNAL.

Each error also carries its structured fields (``InvalidRequest.field`` / ``limit``, ``AdapterNotFound.adapter_id``,
``CheckpointError.file`` / ``tensor``): ``reason`` (the class name in UPPER_SNAKE) and ``details()`` are what the
edge sends as a ``google.rpc.ErrorInfo`` (domain ``DOMAIN``), so clients read them without parsing the message.
Every value in ``details()`` is cut by ``shorten``.

    LoraplexError                     status
    ├── InvalidRequest                INVALID_ARGUMENT
    │   ├── MalformedRequest          the request bytes are not a valid protobuf message
    │   ├── UnsupportedParameter      an OpenAI API parameter this server knows and does not do (HTTP API)
    │   └── UnknownParameter          a parameter the OpenAI API does not have (HTTP API)
    ├── NotFound                      NOT_FOUND
    │   └── AdapterNotFound
    ├── AlreadyExists                 ALREADY_EXISTS
    ├── FailedPrecondition            FAILED_PRECONDITION
    ├── ResourceExhausted             RESOURCE_EXHAUSTED
    │   └── QueueFull
    ├── Unavailable                   UNAVAILABLE
    ├── PermissionDenied              PERMISSION_DENIED
    ├── Unauthenticated               UNAUTHENTICATED
    ├── DeadlineExceeded              DEADLINE_EXCEEDED
    ├── EngineStepFailed              INTERNAL (an exception escaped an engine step; logged there, once)
    └── CheckpointError               INVALID_ARGUMENT (bad files: the caller's input)
        ├── HeaderError               a safetensors header violates the format
        │   └── GGUFError             a GGUF header or tensor table violates the format
        │       └── GGUFUnsupported   FAILED_PRECONDITION: a valid GGUF this server cannot serve (type, arch)
        ├── ShardError                a sharded folder's index is inconsistent
        ├── TensorMismatch            missing / unexpected / mis-shaped tensors against a load plan
        └── InvalidAdapter            an adapter's config or tensors cannot be served
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Self, TypeVar

E = TypeVar("E", bound="LoraplexError")
SHORTEN_CHARS = 200
ECHO_CHARS = 64
DOMAIN = "loraplex"
"""``google.rpc.ErrorInfo.domain`` of every error the server reports."""


def shorten(text: object, n: int = SHORTEN_CHARS) -> str:
    """``str(text)`` cut to ``n`` characters, marked as cut: for every message that echoes user input (ids, paths,
    names from files), so an error can never grow with its input (a 10k-character id once made a NOT_FOUND
    exceed gRPC's metadata limit and arrive as RESOURCE_EXHAUSTED)."""
    s = str(text)
    return s if len(s) <= n else f"{s[:n]}...[{len(s) - n} more characters]"


def echo(text: object, n: int = ECHO_CHARS) -> str:
    """How a message shows a string a client sent (an id, a name): its first ``n`` characters, quoted, with anything
    but printable ASCII escaped (``ascii``: ``\\x00``, ``\\u00e9``), and how many characters were left out."""
    s = str(text)
    head = ascii(s[:n])
    return head if len(s) <= n else f"{head}...[{len(s) - n} more characters]"


def _upper_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper()


class LoraplexError(Exception):
    """Base class. ``status`` is the name of a ``grpc.StatusCode`` member, given as a class keyword
    (``class NotFound(LoraplexError, status="NOT_FOUND")``) and inherited by subclasses; ``fields`` names the
    attributes that ``details()`` reports (those that are not None)."""

    status = "INTERNAL"
    fields: tuple[str, ...] = ()

    def __init_subclass__(cls, *, status: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status

    @property
    def reason(self) -> str:
        """The class name in UPPER_SNAKE (``AdapterNotFound`` -> ``ADAPTER_NOT_FOUND``): ``ErrorInfo.reason``."""
        return _upper_snake(type(self).__name__)

    def details(self) -> dict[str, str]:
        """The structured fields that are set, as strings: ``ErrorInfo.metadata``."""
        values = ((name, getattr(self, name, None)) for name in self.fields)
        return {name: shorten(value) for name, value in values if value is not None}

    def fresh(self: E) -> E:
        """A new instance of this error: the same class, message and fields, no traceback, cause or context.

        For an error kept once and reported to many requests (an adapter's failure): raising the kept instance
        itself would link each raise's frames into its ``__traceback__``, so every request that ever reported it
        (its request, queues, generators) would stay alive as long as the error does."""
        copy = type(self).__new__(type(self))
        copy.args = self.args
        copy.__dict__.update(self.__dict__)
        return copy


class InvalidRequest(LoraplexError, status="INVALID_ARGUMENT"):
    """A request field the server refuses. ``field``: the field at fault, named as the domain request names it
    (``sampling.top_p``, ``stop_sequences[2]``: ``service.frontend.request``) until an edge renames it to its own
    vocabulary (``at``); ``limit``: the bound it broke, where there is one."""

    fields = ("field", "limit")

    def __init__(self, message: str, *, field: str | None = None, limit: int | float | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.limit = limit

    def at(self, field: str | None) -> Self:
        """This error (a ``fresh`` copy) about ``field`` instead: how an edge renames a domain field to its own."""
        copy = self.fresh()
        copy.field = field
        return copy


class MalformedRequest(InvalidRequest): ...


class UnsupportedParameter(InvalidRequest): ...


class UnknownParameter(InvalidRequest): ...


class NotFound(LoraplexError, status="NOT_FOUND"): ...


class AdapterNotFound(NotFound):
    fields = ("adapter_id",)

    def __init__(self, adapter_id: str) -> None:
        super().__init__(f"adapter {echo(adapter_id)} is not registered (see ListAdapters / `loraplex adapters list`)")
        self.adapter_id = adapter_id


class AlreadyExists(LoraplexError, status="ALREADY_EXISTS"): ...


class FailedPrecondition(LoraplexError, status="FAILED_PRECONDITION"): ...


class ResourceExhausted(LoraplexError, status="RESOURCE_EXHAUSTED"): ...


class QueueFull(ResourceExhausted): ...


class Unavailable(LoraplexError, status="UNAVAILABLE"): ...


class PermissionDenied(LoraplexError, status="PERMISSION_DENIED"): ...


class Unauthenticated(LoraplexError, status="UNAUTHENTICATED"): ...


class DeadlineExceeded(LoraplexError, status="DEADLINE_EXCEEDED"): ...


class EngineStepFailed(LoraplexError, status="INTERNAL"):
    """The engine step running a request raised (a bug or a device fault): that step's requests fail, the engine
    goes on. The traceback is logged once by the engine (``event=engine_step_failed``), not once per request."""


class CheckpointError(LoraplexError, status="INVALID_ARGUMENT"):
    """A weight file or folder cannot be loaded. Always names the file, and the tensor where there is one."""

    fields = ("file", "tensor")

    def __init__(self, message: str, *, file: str | Path | None = None, tensor: str | None = None) -> None:
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        where = []
        if self.file is not None:
            where.append(f"file {shorten(self.file)}")
        if tensor is not None:
            where.append(f"tensor {shorten(tensor)!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class HeaderError(CheckpointError): ...


class GGUFError(HeaderError): ...


class GGUFUnsupported(GGUFError, status="FAILED_PRECONDITION"): ...


class ShardError(CheckpointError): ...


class TensorMismatch(CheckpointError): ...


class InvalidAdapter(CheckpointError): ...
