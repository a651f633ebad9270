"""Adapter ids: the one rule every RPC, both APIs and the registry apply.

An id is 1-128 characters of ``[A-Za-z0-9._-]``, not starting with '.' (ids appear in paths, log lines, metric
labels and the HTTP API's ``model`` names). ``check_adapter_id`` runs before any lookup, wherever an id arrives:
a malformed id is INVALID_ARGUMENT on every path, so NOT_FOUND always means a well-formed id that is not
registered. Messages show a client's id through ``service.errors.echo``: a short prefix with anything but printable
ASCII escaped, so an error never grows with its input or carries control characters.
"""

from __future__ import annotations

import re

from service.errors import InvalidRequest, echo

__all__ = ["ADAPTER_ID_MAX_CHARS", "check_adapter_id", "is_adapter_id"]

ADAPTER_ID_MAX_CHARS = 128
_ID = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{ADAPTER_ID_MAX_CHARS - 1}}}")
RULE = f"1-{ADAPTER_ID_MAX_CHARS} characters from [A-Za-z0-9._-], not starting with '.'"


def is_adapter_id(text: object) -> bool:
    """Whether ``text`` is a well-formed adapter id (registered or not)."""
    return isinstance(text, str) and _ID.fullmatch(text) is not None


def check_adapter_id(adapter_id: object, *, field: str = "id") -> None:
    """``InvalidRequest`` naming ``field`` (where the id is in its request: ``adapter_id``, ``id``, ``model``) unless
    ``adapter_id`` is well-formed. The empty id is refused too: callers for which "" means the base model check
    for it first."""
    if is_adapter_id(adapter_id):
        return
    if not isinstance(adapter_id, str) or not adapter_id:
        raise InvalidRequest(f"{field} is empty: an adapter id is {RULE}", field=field)
    if len(adapter_id) > ADAPTER_ID_MAX_CHARS:
        raise InvalidRequest(
            f"{field} has {len(adapter_id)} characters; adapter ids have at most {ADAPTER_ID_MAX_CHARS} "
            f"({echo(adapter_id)})",
            field=field,
            limit=ADAPTER_ID_MAX_CHARS,
        )
    raise InvalidRequest(f"invalid adapter id {echo(adapter_id)} in {field}: use {RULE}", field=field)
