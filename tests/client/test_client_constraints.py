"""The client's output-constraint keywords (``loraplex._constraint``): each kind lands in its field of the
``Constraint`` message of both requests, and what the client can see is wrong is refused before any RPC."""

from __future__ import annotations

import json
from typing import Any

import pytest
from loraplex import _convert
from loraplex.v1 import generation_pb2 as pb

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def _constraint(**kwargs: Any) -> pb.Constraint | None:
    opts = _convert.generation_options(**kwargs)
    unary = _convert.generate_request([pb.Input(text="hi")], opts)
    stream = _convert.stream_request(pb.Input(text="hi"), opts)
    assert unary.HasField("constraint") == stream.HasField("constraint") == (opts.constraint is not None)
    assert unary.constraint == stream.constraint
    return opts.constraint


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"json_schema": SCHEMA}, pb.Constraint(json_schema=json.dumps(SCHEMA))),
        ({"json_schema": '{"type": "integer"}'}, pb.Constraint(json_schema='{"type": "integer"}')),
        ({"json_object": True}, pb.Constraint(json_object=pb.JsonObject())),
        ({"regex": r"\d+"}, pb.Constraint(regex=r"\d+")),
        ({"grammar": 'start: "a"'},
         pb.Constraint(grammar=pb.Grammar(text='start: "a"', dialect=pb.GRAMMAR_DIALECT_LARK))),
        ({"grammar": 'root ::= "a"', "grammar_dialect": "gbnf"},
         pb.Constraint(grammar=pb.Grammar(text='root ::= "a"', dialect=pb.GRAMMAR_DIALECT_GBNF))),
        ({"choice": ["yes", "no"]}, pb.Constraint(choice=pb.Choice(choices=["yes", "no"]))),
        ({"choice": ("é",)}, pb.Constraint(choice=pb.Choice(choices=["é"]))),
    ],
)  # fmt: skip
def test_each_kind_lands_in_its_field(kwargs: dict[str, Any], expected: pb.Constraint) -> None:
    assert _constraint(**kwargs) == expected


def test_no_constraint_leaves_the_field_unset() -> None:
    assert _constraint() is None
    assert _constraint(json_object=False) is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"json_schema": SCHEMA, "regex": "a"}, ValueError, "at most one output constraint; got json_schema, regex"),
        ({"json_object": True, "choice": ["a"]}, ValueError, "json_object, choice"),
        ({"regex": "a", "grammar": "start: a"}, ValueError, "regex, grammar"),
        ({"grammar_dialect": "gbnf"}, ValueError, "only for grammar="),
        ({"json_schema": "{not json"}, ValueError, "json_schema is not JSON"),
        ({"json_schema": "[1, 2]"}, ValueError, "JSON object"),
        ({"json_schema": "true"}, ValueError, "JSON object, got JSON of type bool"),
        ({"json_schema": ""}, ValueError, "json_schema must not be empty"),
        ({"json_schema": b"{}"}, TypeError, "bytes"),
        ({"json_schema": 3}, TypeError, "json_schema must be a str"),
        ({"json_schema": {"x": float("nan")}}, ValueError, "cannot be written as JSON"),
        ({"json_schema": {"x": object()}}, ValueError, "cannot be written as JSON"),
        ({"json_object": "yes"}, TypeError, "json_object must be a bool"),
        ({"regex": " "}, ValueError, "regex must not be empty"),
        ({"regex": 1}, TypeError, "regex must be a str"),
        ({"grammar": ""}, ValueError, "grammar must not be empty"),
        ({"grammar": "start: a", "grammar_dialect": "ebnf"}, ValueError, "grammar_dialect must be one of"),
        ({"grammar": "start: a", "grammar_dialect": 1}, TypeError, "grammar_dialect must be a str"),
        ({"choice": []}, ValueError, "at least one string"),
        ({"choice": "yes"}, TypeError, "list of str"),
        ({"choice": ["a", ""]}, ValueError, r"choice\[1\] must not be empty"),
        ({"choice": ["a", 2]}, TypeError, r"choice\[1\] must be a str"),
    ],
)  # fmt: skip
def test_bad_constraints_are_refused_before_sending(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        _convert.generation_options(**kwargs)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--regex", "a", "--choice", "b"], "not allowed with argument"),
        (["--json-object", "--json-schema", "{}"], "not allowed with argument"),
        (["--grammar-dialect", "gbnf"], "--grammar-dialect is only for --grammar"),
        (["--grammar-dialect", "ebnf", "--grammar", __file__], "invalid choice: 'ebnf'"),
        (["--grammar", "/no/such/grammar.lark"], "cannot read /no/such/grammar.lark"),
        (["--json-schema", "/no/such/schema.json"], "cannot read /no/such/schema.json"),
        (["--json-schema", "{not json"], "json_schema is not JSON"),
        (["--choice", "yes", "--choice", ""], r"choice[1] must not be empty"),
    ],
)
def test_cli_constraint_flags_are_refused_before_any_rpc(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    # Port 1 on loopback: nothing listens, so a request that got as far as an RPC would fail differently.
    try:
        code = main(["generate", "--target", "127.0.0.1:1", "--timeout", "5", *flags, "hi"])
    except SystemExit as exit:  # argparse's own refusals
        code = exit.code  # type: ignore[assignment]
    assert code == 2
    assert message in capsys.readouterr().err
