"""The one exception tree of loraplex.

Internal code raises these; the API edge (``service.api``) maps each to its gRPC status by the class's
``status`` attribute, so the mapping lives in one place and nothing below the servicer imports grpc.
An exception that is not a ``LoraplexError`` reaching the edge is a bug and becomes INTERNAL.

    LoraplexError                     status
    ├── InvalidRequest                INVALID_ARGUMENT
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
    └── CheckpointError               INVALID_ARGUMENT (bad files: the caller's input)
        ├── HeaderError               a safetensors header violates the format
        ├── ShardError                a sharded folder's index is inconsistent
        ├── TensorMismatch            missing / unexpected / mis-shaped tensors against a load plan
        └── InvalidAdapter            an adapter's config or tensors cannot be served
"""

from __future__ import annotations

from pathlib import Path

SHORTEN_CHARS = 200


def shorten(text: object, n: int = SHORTEN_CHARS) -> str:
    """``str(text)`` cut to ``n`` characters, marked as cut: for every message that echoes user input (ids, paths,
    names from files), so an error can never grow with its input (a 10k-character id once made a NOT_FOUND
    exceed gRPC's metadata limit and arrive as RESOURCE_EXHAUSTED)."""
    s = str(text)
    return s if len(s) <= n else f"{s[:n]}...[{len(s) - n} more characters]"


class LoraplexError(Exception):
    """Base class. ``status`` is the name of a ``grpc.StatusCode`` member."""

    status = "INTERNAL"


class InvalidRequest(LoraplexError):
    status = "INVALID_ARGUMENT"


class NotFound(LoraplexError):
    status = "NOT_FOUND"


class AdapterNotFound(NotFound):
    def __init__(self, adapter_id: str) -> None:
        super().__init__(
            f"adapter {shorten(adapter_id)!r} is not registered (see ListAdapters / `loraplex adapters list`)"
        )
        self.adapter_id = adapter_id


class AlreadyExists(LoraplexError):
    status = "ALREADY_EXISTS"


class FailedPrecondition(LoraplexError):
    status = "FAILED_PRECONDITION"


class ResourceExhausted(LoraplexError):
    status = "RESOURCE_EXHAUSTED"


class QueueFull(ResourceExhausted):
    pass


class Unavailable(LoraplexError):
    status = "UNAVAILABLE"


class PermissionDenied(LoraplexError):
    status = "PERMISSION_DENIED"


class Unauthenticated(LoraplexError):
    status = "UNAUTHENTICATED"


class DeadlineExceeded(LoraplexError):
    status = "DEADLINE_EXCEEDED"


class CheckpointError(LoraplexError):
    """A weight file or folder cannot be loaded. Always names the file, and the tensor where there is one."""

    status = "INVALID_ARGUMENT"

    def __init__(self, message: str, *, file: str | Path | None = None, tensor: str | None = None) -> None:
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        where = []
        if self.file is not None:
            where.append(f"file {shorten(self.file)}")
        if tensor is not None:
            where.append(f"tensor {shorten(tensor)!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class HeaderError(CheckpointError):
    pass


class ShardError(CheckpointError):
    pass


class TensorMismatch(CheckpointError):
    pass


class InvalidAdapter(CheckpointError):
    pass
