"""Structured outputs over the OpenAI HTTP API: ``response_format`` and vLLM's spellings -> one domain ``Constraint``.

Accepted (docs/http.md, "Structured outputs"), on ``/v1/chat/completions`` and ``/v1/completions`` alike:

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs`` object: exactly one of ``json`` (a schema: an object or a JSON string), ``regex``,
  ``choice`` (strings), ``grammar`` (GBNF or Lark, told apart by ``grammar_dialect``), ``json_object: true``;
- vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

At most one of them per request (two: 400 naming both). Only the shape is checked here, as every other parameter
is in ``params``; sizes and counts are bounded by ``service.constraints.spec.check_constraint`` and the schema,
pattern or grammar itself by the backend when it compiles it, both in the frontend. Their errors name the domain
field (``constraint``, ``constraint.<kind>``); ``rename`` turns that into the HTTP parameter the constraint came
from (``response_format.json_schema.schema``, ``structured_outputs.regex``, ``guided_choice``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.constraints.spec import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint
from service.errors import InvalidRequest, UnknownParameter, UnsupportedParameter, echo

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's older top-level spellings, each the ``structured_outputs`` field of the same suffix."""

UNSUPPORTED: Mapping[str, str] = {
    "guided_decoding_backend": "choosing the constraint backend (it is always llguidance)",
    "guided_whitespace_pattern": "whitespace patterns for JSON",
    "structural_tag": "structural tags",
}
"""vLLM's top-level structured-output parameters this server knows and refuses unless null."""

NAMES = frozenset({"response_format", "structured_outputs", *GUIDED, *UNSUPPORTED})
"""Every top-level parameter this module reads (``params`` adds them to the names it knows)."""

_KINDS = {"json": JSON_SCHEMA, "regex": REGEX, "choice": CHOICE, "grammar": GRAMMAR, "json_object": JSON_OBJECT}
"""``structured_outputs`` fields that are a constraint -> its kind."""

_OPTIONS: Mapping[str, object] = {
    "disable_fallback": None,  # any boolean: there is no fallback backend, so it can never fall back
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
    "grammar_dialect": None,  # ours: "gbnf" or "lark" (default: guessed, see ``_dialect``)
}
"""The other ``structured_outputs`` fields -> the only value accepted beside null (None: see ``_options``)."""

_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z_][A-Za-z0-9_.-]*[ \t]*::=", re.M)
"""A GBNF rule definition at the start of a line (``root ::= ...``); Lark writes ``start: ...``."""


@dataclass(frozen=True)
class Structured:
    """A request's output constraint (None: free text) and the HTTP parameter that gave it (its errors' ``param``)."""

    constraint: Constraint | None = None
    param: str | None = None


def parse(given: Mapping[str, Any]) -> Structured:
    """The constraint of a request's non-null top-level parameters ``given``; raises ``InvalidRequest`` naming the
    parameter at fault (``response_format.json_schema.schema``)."""
    for name, what in UNSUPPORTED.items():
        if name in given:
            raise UnsupportedParameter(f"{name!r} is not supported: this server does not do {what}", field=name)
    found: list[Structured] = []
    if "response_format" in given:
        found.append(_response_format(given["response_format"]))
    if "structured_outputs" in given:
        found.append(_structured_outputs(given["structured_outputs"]))
    for name in GUIDED:
        if name in given:
            field = name.removeprefix("guided_")
            found.append(_constraint(field, given[name], name, None))
    found = [s for s in found if s.constraint is not None]
    if len(found) > 1:
        first, second = found[0].param, found[1].param
        raise InvalidRequest(
            f"{first} and {second} both constrain the output: give at most one output constraint",
            field=second,
        )
    return found[0] if found else Structured()


def rename(exc: Exception, param: str | None) -> Exception:
    """``exc`` about ``param`` where it is an ``InvalidRequest`` about the domain constraint (``constraint``,
    ``constraint.json_schema``: a limit, or a schema the backend refused); ``exc`` itself otherwise."""
    field = getattr(exc, "field", None)
    if param is None or not isinstance(exc, InvalidRequest) or not isinstance(field, str):
        return exc
    if field == "constraint" or field.startswith("constraint."):
        return exc.at(param)
    return exc


# ----------------------------------------------------------------------------------------------- response_format


def _response_format(value: object) -> Structured:
    where = "response_format"
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be an object with a type", field=where)
    kind = value.get("type")
    if not isinstance(kind, str):
        raise InvalidRequest(f"{where}.type must be 'text', 'json_object' or 'json_schema'", field=f"{where}.type")
    if kind == "structural_tag":
        raise UnsupportedParameter(
            f"{where}.type 'structural_tag' is not supported: this server does not do structural tags",
            field=f"{where}.type",
        )
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(
            f"{where}.type must be 'text', 'json_object' or 'json_schema', got {echo(kind)}", field=f"{where}.type"
        )
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    _only(value, allowed, where)
    if kind == "text":
        return Structured()
    if kind == "json_object":
        return Structured(Constraint(JSON_OBJECT), where)
    where = f"{where}.json_schema"
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{where} must be an object with a name and a schema", field=where)
    _only(spec, {"name", "schema", "strict", "description"}, where)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{where}.name must be a non-empty string", field=f"{where}.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequest(f"{where}.strict must be true or false", field=f"{where}.strict")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise InvalidRequest(f"{where}.description must be a string", field=f"{where}.description")
    if spec.get("schema") is None:
        raise InvalidRequest(
            f"{where}.schema is required: the JSON schema the output must match", field=f"{where}.schema"
        )
    if not isinstance(spec["schema"], dict):  # a string is vLLM's structured_outputs.json, not OpenAI's schema
        raise InvalidRequest(f"{where}.schema must be a JSON schema object", field=f"{where}.schema")
    return Structured(Constraint(JSON_SCHEMA, _schema_text(spec["schema"], f"{where}.schema")), f"{where}.schema")


# ------------------------------------------------------------------------------------------- structured_outputs


def _structured_outputs(value: object) -> Structured:
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be an object", field=where)
    given = {k: v for k, v in value.items() if v is not None}
    _only(given, {*_KINDS, *_OPTIONS}, where)
    _options(given, where)
    kinds = [name for name in _KINDS if name in given and given[name] is not False]  # json_object: false = unset
    if not kinds:
        raise InvalidRequest(f"{where} names no constraint: give one of {', '.join(_KINDS)}", field=where)
    if len(kinds) > 1:
        raise InvalidRequest(
            f"{where}.{kinds[0]} and {where}.{kinds[1]} both constrain the output: give one of them",
            field=f"{where}.{kinds[1]}",
        )
    return _constraint(kinds[0], given[kinds[0]], f"{where}.{kinds[0]}", _dialect_of(given, where))


def _options(given: Mapping[str, Any], where: str) -> None:
    for name, accepted in _OPTIONS.items():
        if name not in given or name == "grammar_dialect":
            continue
        value = given[name]
        if name == "disable_fallback":
            if not isinstance(value, bool):
                raise InvalidRequest(f"{where}.{name} must be true or false", field=f"{where}.{name}")
        elif value != accepted or (accepted is False and not isinstance(value, bool)):
            only = "null" if accepted is None else f"{json.dumps(accepted)} or null"
            raise UnsupportedParameter(f"{where}.{name} is not supported (only {only})", field=f"{where}.{name}")


def _dialect_of(given: Mapping[str, Any], where: str) -> str | None:
    """The explicit ``grammar_dialect`` (None: guess it from the grammar)."""
    if "grammar_dialect" not in given:
        return None
    dialect = given["grammar_dialect"]
    if dialect not in ("gbnf", "lark"):
        raise InvalidRequest(
            f"{where}.grammar_dialect must be 'gbnf' or 'lark', got {echo(dialect)}", field=f"{where}.grammar_dialect"
        )
    if "grammar" not in given:
        raise InvalidRequest(
            f"{where}.grammar_dialect is only allowed with a grammar", field=f"{where}.grammar_dialect"
        )
    return str(dialect)


# ---------------------------------------------------------------------------------------------------- values


def _constraint(field: str, value: object, param: str, dialect: str | None) -> Structured:
    """The constraint of one ``structured_outputs`` field (``json``, ``regex``, ...) given as ``param``."""
    if field == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                raise InvalidRequest(f"{param} is a string that is not valid JSON", field=param) from None
        if not isinstance(value, dict):
            raise InvalidRequest(f"{param} must be a JSON schema: an object, or a string holding one", field=param)
        return Structured(Constraint(JSON_SCHEMA, _schema_text(value, param)), param)
    if field == "json_object":
        if value is not True:
            raise InvalidRequest(f"{param} must be true or false", field=param)
        return Structured(Constraint(JSON_OBJECT), param)
    if field == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(s, str) and s for s in value):
            raise InvalidRequest(f"{param} must be a non-empty array of non-empty strings", field=param)
        return Structured(Constraint(CHOICE, choices=tuple(value)), param)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{param} must be a non-empty string", field=param)
    if field == "regex":
        return Structured(Constraint(REGEX, value), param)
    return Structured(Constraint(GRAMMAR, value, dialect=dialect or guess_dialect(value)), param)


def guess_dialect(grammar: str) -> str:
    """``gbnf`` where a line starts a GBNF rule (``name ::=``), else ``lark`` (as vLLM tells them apart)."""
    return "gbnf" if _GBNF_RULE.search(grammar) else "lark"


def _schema_text(schema: dict[str, Any], param: str) -> str:
    """The schema as compact JSON text (key order kept: it is the order the output's properties come in)."""
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        text.encode("utf-8")
    except RecursionError:
        raise InvalidRequest(f"{param} is nested too deeply", field=param) from None
    except ValueError:  # NaN / Infinity, or a lone surrogate (UnicodeEncodeError)
        raise InvalidRequest(
            f"{param} holds a value JSON cannot carry (NaN, Infinity, a lone surrogate)", field=param
        ) from None
    return text


def _only(value: Mapping[str, Any], allowed: set[str], where: str) -> None:
    for name, item in value.items():
        if name not in allowed and item is not None:  # a null field is an absent one, as at the top level
            raise UnknownParameter(f"unknown parameter {where}.{echo(name)}", field=f"{where}.{name[:64]}")


__all__ = ["NAMES", "Structured", "guess_dialect", "parse", "rename"]
