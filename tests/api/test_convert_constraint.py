"""The gRPC edge of output constraints (``service.api.convert``): a ``Constraint`` message becomes the domain
``Constraint`` (no model, no server), a grammar without a dialect is refused naming its field, and the new
``DEAD_END`` finish reason reaches the wire. The server's answers are tested end to end in
test_grpc_constraints.py and test_bad_input_matrix.py."""

from __future__ import annotations

import pytest
from loraplex.v1 import generation_pb2 as pb

from service.api import convert
from service.constraints.spec import Constraint
from service.errors import InvalidRequest
from service.frontend import Completion, FinishReason

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}}'


def _requests(**constraint: object) -> list[pb.GenerateRequest | pb.GenerateStreamRequest]:
    message = pb.Constraint(**constraint)  # type: ignore[arg-type]
    return [
        pb.GenerateRequest(inputs=[pb.Input(text="hi")], constraint=message),
        pb.GenerateStreamRequest(input=pb.Input(text="hi"), constraint=message),
    ]


@pytest.mark.parametrize(
    ("constraint", "domain"),
    [
        ({"json_schema": SCHEMA}, Constraint("json_schema", source=SCHEMA)),
        ({"json_object": pb.JsonObject()}, Constraint("json_object")),
        ({"regex": r"\d{3}"}, Constraint("regex", source=r"\d{3}")),
        ({"grammar": pb.Grammar(text='start: "a"', dialect=pb.GRAMMAR_DIALECT_LARK)},
         Constraint("grammar", source='start: "a"', dialect="lark")),
        ({"grammar": pb.Grammar(text='root ::= "a"', dialect=pb.GRAMMAR_DIALECT_GBNF)},
         Constraint("grammar", source='root ::= "a"', dialect="gbnf")),
        ({"choice": pb.Choice(choices=["yes", "no"])}, Constraint("choice", choices=("yes", "no"))),
        # Empty values still name their kind: the frontend's check refuses them, naming the field.
        ({"json_schema": ""}, Constraint("json_schema")),
        ({"choice": pb.Choice()}, Constraint("choice")),
    ],
)  # fmt: skip
def test_each_kind_becomes_its_domain_constraint(constraint: dict[str, object], domain: Constraint) -> None:
    for request in _requests(**constraint):
        assert convert.call_of(request, deadline=None).constraint == domain


def test_no_constraint_is_free_text() -> None:
    for request in [pb.GenerateRequest(inputs=[pb.Input(text="hi")]), pb.GenerateStreamRequest()]:
        assert convert.call_of(request, deadline=None).constraint is None
    for request in _requests():  # the message set, but no kind in its oneof
        assert convert.call_of(request, deadline=None).constraint is None


@pytest.mark.parametrize(("dialect", "named"), [(pb.GRAMMAR_DIALECT_UNSPECIFIED, "GRAMMAR_DIALECT_UNSPECIFIED"),
                                                (7, "7")])  # fmt: skip
def test_a_grammar_needs_a_known_dialect(dialect: int, named: str) -> None:
    for request in _requests(grammar=pb.Grammar(text='start: "a"', dialect=dialect)):  # type: ignore[arg-type]
        stream = isinstance(request, pb.GenerateStreamRequest)
        with pytest.raises(InvalidRequest, match=named) as caught, convert.grpc_fields(stream=stream):
            convert.call_of(request, deadline=None)
        assert caught.value.field == "constraint.grammar.dialect"


@pytest.mark.parametrize("domain", ["constraint", "constraint.json_schema", "constraint.choice"])
def test_constraint_fields_keep_their_names_on_the_wire(domain: str) -> None:
    assert convert.field_of(domain, stream=False) == convert.field_of(domain, stream=True) == domain


def test_dead_end_has_its_own_finish_reason() -> None:
    assert set(convert.FINISH_TO_PB) == set(FinishReason)
    completion = Completion("{", (1,), (), FinishReason.DEAD_END, "", 3, 1, 0)
    result = convert.result_of(completion, pb.ReturnOptions())
    assert result.finish_reason == pb.FINISH_REASON_DEAD_END
