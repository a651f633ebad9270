"""Output constraints (structured output) as a ``loraplex.v1.Constraint`` message, from ``generate`` / ``stream``
keywords: at most one of ``json_schema``, ``json_object``, ``regex``, ``grammar`` (with ``grammar_dialect``) and
``choice``. What the client can see is wrong (two kinds at once, wrong types, empty text or lists, a schema that is
not JSON) raises ``TypeError`` / ``ValueError`` before any RPC; whether a schema, pattern or grammar compiles, and
the server's size limits, are the server's to check (INVALID_ARGUMENT naming ``constraint.<kind>``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from loraplex.v1 import generation_pb2

DIALECTS = {"lark": generation_pb2.GRAMMAR_DIALECT_LARK, "gbnf": generation_pb2.GRAMMAR_DIALECT_GBNF}
"""``grammar_dialect`` names: Lark (llguidance's syntax, start rule ``start``) and llama.cpp's GBNF (``root``)."""

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{name} must not be empty")
    return value


def _schema(value: object) -> str:
    """A JSON schema as JSON text: a mapping is serialised; a str must already be a JSON object's text."""
    if isinstance(value, Mapping):
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"json_schema cannot be written as JSON: {exc}") from None
    if isinstance(value, (bytes, bytearray)):
        raise TypeError("json_schema must be a dict or a str of JSON, not bytes: decode it first")
    text = _text("json_schema", value)  # a str; anything else is the TypeError here
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"json_schema is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"json_schema must be a JSON object, got JSON of type {type(parsed).__name__}")
    return text


def _choices(value: object) -> list[str]:
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise TypeError(f"choice must be a list of str, got {type(value).__name__}")
    items = list(value)
    if not items:
        raise ValueError("choice needs at least one string")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(f"choice[{i}] must be a str, got {type(item).__name__}")
        if not item:
            raise ValueError(f"choice[{i}] must not be empty")
    return items


def constraint_message(
    *,
    json_schema: Mapping[str, Any] | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    grammar_dialect: str | None = None,
    choice: Sequence[str] | None = None,
) -> generation_pb2.Constraint | None:
    """The ``Constraint`` message of the keywords given (None: none given, free text). Raises ``ValueError`` when
    more than one kind is given, or ``grammar_dialect`` without ``grammar``."""
    if not isinstance(json_object, bool):
        raise TypeError(f"json_object must be a bool, got {type(json_object).__name__}")
    given = {"json_schema": json_schema, "regex": regex, "grammar": grammar, "choice": choice}
    kinds = [k for k in KINDS if (json_object if k == "json_object" else given[k] is not None)]
    if len(kinds) > 1:
        raise ValueError(f"give at most one output constraint; got {', '.join(kinds)}")
    if grammar_dialect is not None and grammar is None:
        raise ValueError("grammar_dialect is only for grammar=")
    if not kinds:
        return None
    if json_schema is not None:
        return generation_pb2.Constraint(json_schema=_schema(json_schema))
    if json_object:
        return generation_pb2.Constraint(json_object=generation_pb2.JsonObject())
    if regex is not None:
        return generation_pb2.Constraint(regex=_text("regex", regex))
    if grammar is not None:
        dialect = "lark" if grammar_dialect is None else grammar_dialect
        if not isinstance(dialect, str):
            raise TypeError(f"grammar_dialect must be a str, got {type(dialect).__name__}")
        if dialect not in DIALECTS:
            raise ValueError(f"grammar_dialect must be one of {sorted(DIALECTS)}, got {dialect!r}")
        return generation_pb2.Constraint(
            grammar=generation_pb2.Grammar(text=_text("grammar", grammar), dialect=DIALECTS[dialect])
        )
    return generation_pb2.Constraint(choice=generation_pb2.Choice(choices=_choices(choice)))
