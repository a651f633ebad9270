"""Structured outputs at the HTTP edge, without a server: every accepted spelling (OpenAI's ``response_format``,
vLLM's ``structured_outputs`` and ``guided_*``) becomes the right domain ``Constraint``; every malformed value is
refused with ``param`` naming the field; a domain constraint error is renamed to the parameter it came from."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.api.http import errors, params, structured
from service.constraints.spec import Constraint
from service.errors import InvalidRequest, UnknownParameter, UnsupportedParameter
from service.frontend import FinishReason

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
SCHEMA_TEXT = '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}}}'
GBNF = 'root ::= "yes" | "no"\n'
LARK = 'start: "yes" | "no"\n'


def parsed(kind: params.Kind = "chat", **extra: Any) -> params.Call:
    body: dict[str, Any] = {"model": "m", **extra}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return params.parse(kind, body, request_id="r", adapter_of=lambda model: "")


@pytest.mark.parametrize(
    ("extra", "constraint", "param"),
    [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, Constraint("json_object"), "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
         Constraint("json_schema", SCHEMA_TEXT), "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMA, "strict": False, "description": "a person"}}},
         Constraint("json_schema", SCHEMA_TEXT), "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": SCHEMA}}, Constraint("json_schema", SCHEMA_TEXT), "structured_outputs.json"),
        ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, Constraint("json_schema", SCHEMA_TEXT),
         "structured_outputs.json"),
        ({"structured_outputs": {"regex": r"\d{3}"}}, Constraint("regex", r"\d{3}"), "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, Constraint("choice", choices=("a", "b")),
         "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": GBNF}}, Constraint("grammar", GBNF, "gbnf"), "structured_outputs.grammar"),
        ({"structured_outputs": {"grammar": LARK}}, Constraint("grammar", LARK, "lark"), "structured_outputs.grammar"),
        ({"structured_outputs": {"grammar": LARK, "grammar_dialect": "gbnf"}}, Constraint("grammar", LARK, "gbnf"),
         "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": True}}, Constraint("json_object"), "structured_outputs.json_object"),
        ({"structured_outputs": {"regex": "a+", "json_object": False, "disable_fallback": True,
                                 "disable_any_whitespace": False, "whitespace_pattern": None}},
         Constraint("regex", "a+"), "structured_outputs.regex"),
        ({"guided_json": SCHEMA}, Constraint("json_schema", SCHEMA_TEXT), "guided_json"),
        ({"guided_json": json.dumps(SCHEMA)}, Constraint("json_schema", SCHEMA_TEXT), "guided_json"),
        ({"guided_regex": "[a-z]+"}, Constraint("regex", "[a-z]+"), "guided_regex"),
        ({"guided_choice": ["x"]}, Constraint("choice", choices=("x",)), "guided_choice"),
        ({"guided_grammar": GBNF}, Constraint("grammar", GBNF, "gbnf"), "guided_grammar"),
        ({"guided_grammar": LARK}, Constraint("grammar", LARK, "lark"), "guided_grammar"),
        ({"response_format": {"type": "text"}, "guided_regex": "a"}, Constraint("regex", "a"), "guided_regex"),
        ({"response_format": None, "structured_outputs": None, "guided_json": None}, None, None),
        ({"response_format": {"type": "text", "json_schema": None}}, None, None),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": None,
                                                                     "description": None}}},
         Constraint("json_schema", SCHEMA_TEXT), "response_format.json_schema.schema"),
        ({}, None, None),
    ],
)  # fmt: skip
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_every_spelling_becomes_its_constraint(
    kind: params.Kind, extra: dict[str, Any], constraint: Constraint | None, param: str | None
) -> None:
    call = parsed(kind, **extra)
    assert call.request.constraint == constraint
    assert call.constraint_param == param
    assert [call.choice(i).constraint for i in range(call.choices)] == [constraint] * call.choices


def test_schema_key_order_is_kept() -> None:
    schema = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "string"}}}
    call = parsed(structured_outputs={"json": schema})
    assert call.request.constraint is not None
    assert list(json.loads(call.request.constraint.source)["properties"]) == ["z", "a"]


@pytest.mark.parametrize(
    ("grammar", "dialect"),
    [
        ('root ::= "a"', "gbnf"),
        ("  root   ::= item+\nitem ::= [a-z]", "gbnf"),
        ('# a comment\nroot-rule ::= "x"', "gbnf"),
        ('start: "a"', "lark"),
        ('start: "::="', "lark"),  # a Lark string holding GBNF's operator is still Lark
        ("%llguidance {}\nstart: /[0-9]+/", "lark"),
    ],
)
def test_grammar_dialect_is_gbnf_where_a_line_defines_a_gbnf_rule(grammar: str, dialect: str) -> None:
    assert structured.guess_dialect(grammar) == dialect


BAD: list[tuple[dict[str, Any], str, type[InvalidRequest], str]] = [
    ({"response_format": "json"}, "response_format", InvalidRequest, "must be an object"),
    ({"response_format": {}}, "response_format.type", InvalidRequest, "type must be"),
    ({"response_format": {"type": "xml"}}, "response_format.type", InvalidRequest, "'xml'"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", UnsupportedParameter, "structural"),
    ({"response_format": {"type": "text", "json_schema": {}}}, "response_format.json_schema", UnknownParameter,
     "unknown parameter"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema", UnknownParameter,
     "unknown parameter"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", InvalidRequest, "name and a schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", InvalidRequest, "name must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "", "schema": SCHEMA}}},
     "response_format.json_schema.name", InvalidRequest, "name must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", InvalidRequest, "schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema", InvalidRequest, "JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", InvalidRequest, "JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", InvalidRequest, "true or false"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "description": 1}}},
     "response_format.json_schema.description", InvalidRequest, "string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1}}},
     "response_format.json_schema.extra", UnknownParameter, "unknown parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": float("nan")}}}},
     "response_format.json_schema.schema", InvalidRequest, "NaN"),
    ({"structured_outputs": "regex"}, "structured_outputs", InvalidRequest, "must be an object"),
    ({"structured_outputs": {}}, "structured_outputs", InvalidRequest, "names no constraint"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", InvalidRequest, "names no constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", InvalidRequest,
     "structured_outputs.regex and structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", InvalidRequest, "not valid JSON"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json", InvalidRequest, "JSON schema"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json", InvalidRequest, "JSON schema"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", InvalidRequest, "non-empty string"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", InvalidRequest, "non-empty string"),
    ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar", InvalidRequest, "non-empty string"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", InvalidRequest, "non-empty array"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", InvalidRequest, "non-empty array"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice", InvalidRequest, "non-empty"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice", InvalidRequest, "strings"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", InvalidRequest,
     "true or false"),
    ({"structured_outputs": {"regex": "a", "made_up": 1}}, "structured_outputs.made_up", UnknownParameter,
     "unknown parameter"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", UnsupportedParameter, "not supported"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     UnsupportedParameter, "only null"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "structured_outputs.structural_tag",
     UnsupportedParameter, "not supported"),
    ({"structured_outputs": {"regex": "a", "disable_fallback": 1}}, "structured_outputs.disable_fallback",
     InvalidRequest, "true or false"),
    ({"structured_outputs": {"grammar": LARK, "grammar_dialect": "ebnf"}}, "structured_outputs.grammar_dialect",
     InvalidRequest, "'gbnf' or 'lark'"),
    ({"structured_outputs": {"regex": "a", "grammar_dialect": "lark"}}, "structured_outputs.grammar_dialect",
     InvalidRequest, "only allowed with a grammar"),
    ({"guided_json": "nope"}, "guided_json", InvalidRequest, "not valid JSON"),
    ({"guided_regex": ["a"]}, "guided_regex", InvalidRequest, "non-empty string"),
    ({"guided_choice": "a"}, "guided_choice", InvalidRequest, "non-empty array"),
    ({"guided_grammar": 1}, "guided_grammar", InvalidRequest, "non-empty string"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", UnsupportedParameter, "not supported"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", UnsupportedParameter, "not supported"),
    ({"structural_tag": "{}"}, "structural_tag", UnsupportedParameter, "not supported"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", InvalidRequest,
     "response_format and guided_regex"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice", InvalidRequest,
     "structured_outputs.regex and guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
      "structured_outputs": {"json": SCHEMA}}, "structured_outputs.json", InvalidRequest, "at most one"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "error", "fragment"), BAD)
def test_bad_values_are_refused_naming_the_field(
    extra: dict[str, Any], param: str, error: type[InvalidRequest], fragment: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parsed(**extra)
    assert type(refused.value) is error
    assert refused.value.field == param
    assert fragment.lower() in str(refused.value).lower()
    body = errors.error_body(refused.value, chat=True)["error"]
    assert body["param"] == param and body["type"] == "invalid_request_error"


def test_an_unknown_field_is_cut_in_the_param_and_escaped_in_the_message() -> None:
    name = "\x00" + "x" * 500
    with pytest.raises(UnknownParameter) as refused:
        parsed(structured_outputs={"regex": "a", name: 1})
    assert refused.value.field == f"structured_outputs.{name[:64]}"
    assert "\x00" not in str(refused.value) and len(str(refused.value)) < 200


@pytest.mark.parametrize(
    ("field", "param", "renamed"),
    [
        ("constraint", "guided_regex", "guided_regex"),
        ("constraint.json_schema", "response_format.json_schema.schema", "response_format.json_schema.schema"),
        ("constraint.choice", "structured_outputs.choice", "structured_outputs.choice"),
        ("constraints", "guided_regex", "constraints"),  # not the domain constraint field
        ("max_new_tokens", "guided_regex", "max_new_tokens"),
        ("constraint", None, "constraint"),
    ],
)
def test_a_constraint_error_is_renamed_to_the_parameter_it_came_from(
    field: str, param: str | None, renamed: str
) -> None:
    exc = InvalidRequest("the schema is bad", field=field, limit=3)
    out = structured.rename(exc, param)
    assert isinstance(out, InvalidRequest)
    assert (out.field, out.limit, str(out)) == (renamed, 3, "the schema is bad")
    assert exc.field == field  # the original is left alone
    other = ValueError("x")
    assert structured.rename(other, param) is other


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_dead_end_finishes_with_dead_end(kind: params.Kind) -> None:
    """The engine's ``DEAD_END`` (the constraint allowed no next token) is its own finish reason, whole and
    streamed: ``stop`` would claim a complete output, and OpenAI has no value for it."""
    from service.api.http.replies import Replies
    from service.frontend import Completion, Generated, TokenEvent

    call = parsed(kind, guided_regex="a+b")
    done = Completion("aa", (1, 1), (), FinishReason.DEAD_END, "", 3, 2, 0)
    body = Replies(call, "r", None).completion(Generated("r", (done,)))  # type: ignore[arg-type]
    assert body["choices"][0]["finish_reason"] == "dead_end"
    chunks = Replies(call, "r", None).chunks(0, TokenEvent((1,), "a", finish=FinishReason.DEAD_END))  # type: ignore[arg-type]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == ["dead_end"]
