"""Structured output over real loopback gRPC with the real SmolLM2: every kind of ``Constraint`` (a JSON schema,
any JSON object, a regex, a choice, a Lark and a GBNF grammar) through Generate and GenerateStream, checked with
the tools a client would use (``jsonschema``, ``re.fullmatch``); the Python client's keywords and ``loraplex
generate``'s flags reach the same server. A constraint that does not compile is INVALID_ARGUMENT naming its field
and the problem, and the server keeps serving. One server for the module; greedy throughout."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import loraplex
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.servers import tiny_settings

from service.api.server import BackgroundServer

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"
LARK = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/\n'
LARK_MATCH = r"The answer is [0-9]{1,3}\."
GBNF = 'root ::= answer "!"\nanswer ::= "yes" | "no"\n'
COLOURS = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[BackgroundServer]:
    settings = tiny_settings(smollm2_dir, max_new_tokens=96, max_prompt_tokens=256, max_total_tokens=512)
    with BackgroundServer(settings) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: BackgroundServer) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.GenerationStub(channel)


def _request(prompt: str, constraint: pb.Constraint, n: int = 96, inputs: int = 1) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        inputs=[pb.Input(text=prompt, chat=True)] * inputs,
        stopping=pb.StoppingCriteria(max_new_tokens=n),
        constraint=constraint,
    )


def _both(stub: pb_grpc.GenerationStub, prompt: str, constraint: pb.Constraint, n: int = 96) -> str:
    """The greedy text of Generate, after checking that GenerateStream gives the same text and finish reason."""
    request = _request(prompt, constraint, n)
    (result,) = stub.Generate(request, timeout=120).results
    stream = pb.GenerateStreamRequest(input=request.inputs[0], stopping=request.stopping, constraint=constraint)
    messages = list(stub.GenerateStream(stream, timeout=120))
    assert "".join(m.text for m in messages) == result.text
    assert messages[-1].finish_reason == result.finish_reason
    assert result.finish_reason == pb.FINISH_REASON_EOS, (pb.FinishReason.Name(result.finish_reason), result.text)
    return result.text


def test_json_schema_output_parses_and_validates(stub: pb_grpc.GenerationStub) -> None:
    text = _both(
        stub, "Describe a person as JSON with a name and an age.", pb.Constraint(json_schema=json.dumps(PERSON))
    )
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_output_is_an_object(stub: pb_grpc.GenerationStub) -> None:
    text = _both(
        stub,
        'Give a JSON object with one key, "animal", whose value is "cat".',
        pb.Constraint(json_object=pb.JsonObject()),
        n=64,
    )
    assert isinstance(json.loads(text), dict)


def test_regex_output_matches_whole(stub: pb_grpc.GenerationStub) -> None:
    text = _both(stub, "Make up a phone number.", pb.Constraint(regex=PHONE))
    assert re.fullmatch(PHONE, text), text


def test_choice_output_is_one_of_the_choices(stub: pb_grpc.GenerationStub) -> None:
    text = _both(stub, "What colour is the sky?", pb.Constraint(choice=pb.Choice(choices=COLOURS)))
    assert text in COLOURS


@pytest.mark.parametrize(
    ("grammar", "match"),
    [
        (pb.Grammar(text=LARK, dialect=pb.GRAMMAR_DIALECT_LARK), LARK_MATCH),
        (pb.Grammar(text=GBNF, dialect=pb.GRAMMAR_DIALECT_GBNF), r"(yes|no)!"),
    ],
    ids=["lark", "gbnf"],
)
def test_grammar_output_is_a_sentence_of_it(stub: pb_grpc.GenerationStub, grammar: pb.Grammar, match: str) -> None:
    text = _both(stub, "What is 6 times 7? Is that right?", pb.Constraint(grammar=grammar))
    assert re.fullmatch(match, text), text


def test_every_input_of_a_batch_is_constrained(stub: pb_grpc.GenerationStub) -> None:
    request = _request("Make up a phone number.", pb.Constraint(regex=PHONE), inputs=2)
    request.inputs[1].text = "Your number, please?"
    results = stub.Generate(request, timeout=120).results
    assert len(results) == 2 and all(re.fullmatch(PHONE, r.text) for r in results), [r.text for r in results]


def _refusal(stub: pb_grpc.GenerationStub, constraint: pb.Constraint, *, stream: bool) -> tuple[str, str, str]:
    """(status code name, message, ErrorInfo field) of a refused request."""
    request = _request("hi", constraint, n=4)
    with pytest.raises(grpc.RpcError) as caught:
        if stream:
            list(stub.GenerateStream(pb.GenerateStreamRequest(input=request.inputs[0], constraint=constraint)))
        else:
            stub.Generate(request, timeout=60)
    status = rpc_status.from_call(caught.value)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return caught.value.code().name, caught.value.details() or "", info.metadata.get("field", "")


@pytest.mark.parametrize(
    ("constraint", "field", "problem"),
    [
        (pb.Constraint(json_schema="{not json"), "constraint.json_schema", "json"),
        (pb.Constraint(json_schema='{"type": "no-such-type"}'), "constraint.json_schema", "no-such-type"),
        (pb.Constraint(regex="(unclosed"), "constraint.regex", "unclosed"),
        (pb.Constraint(grammar=pb.Grammar(text="start: (", dialect=pb.GRAMMAR_DIALECT_LARK)), "constraint.grammar",
         "expected"),
        (pb.Constraint(grammar=pb.Grammar(text="root ::= (", dialect=pb.GRAMMAR_DIALECT_GBNF)), "constraint.grammar",
         "root"),
        (pb.Constraint(grammar=pb.Grammar(text='start: "a"')), "constraint.grammar.dialect", "dialect"),
    ],
    ids=["schema-not-json", "schema-bad-type", "regex", "lark", "gbnf", "no-dialect"],
)  # fmt: skip
def test_a_constraint_that_does_not_compile_is_refused_by_name(
    stub: pb_grpc.GenerationStub, constraint: pb.Constraint, field: str, problem: str
) -> None:
    for stream in (False, True):
        code, message, named = _refusal(stub, constraint, stream=stream)
        assert (code, named) == ("INVALID_ARGUMENT", field), message
        assert problem.lower() in message.lower(), message
    # The server keeps serving, constrained and not.
    assert re.fullmatch(PHONE, _both(stub, "Make up a phone number.", pb.Constraint(regex=PHONE)))


def test_the_client_and_the_cli_reach_the_same_constraint(
    server: BackgroundServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from service.cli import main

    prompt = "Describe a person as JSON with a name and an age."
    with loraplex.Client(server.target, timeout=120) as client:
        assert "constraints" in client.model_info().features
        one = client.generate(prompt, chat=True, json_schema=PERSON, max_new_tokens=96)
        assert one.finish_reason is loraplex.FinishReason.EOS
        jsonschema.validate(json.loads(one.text), PERSON)
        deltas = list(client.stream("What colour is the sky?", chat=True, choice=COLOURS))
        assert "".join(d.text for d in deltas) in COLOURS
        with pytest.raises(loraplex.InvalidArgument) as refused:
            client.generate("hi", regex="(unclosed", max_new_tokens=4)
        assert refused.value.details["field"] == "constraint.regex"

    async def phone() -> str:
        async with loraplex.AsyncClient(server.target, timeout=120) as client:
            return (await client.generate("Make up a phone number.", chat=True, regex=PHONE)).text

    assert re.fullmatch(PHONE, asyncio.run(phone()))
    assert main(["generate", "--target", server.target, "--json", "--max-new-tokens", "96",
                 "--json-schema", json.dumps(PERSON), prompt]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["text"] == one.text
    (tmp_path / "schema.json").write_text(json.dumps(PERSON))
    (tmp_path / "answer.gbnf").write_text(GBNF)
    assert main(["generate", "--target", server.target, "--json", "--max-new-tokens", "96",
                 "--json-schema", str(tmp_path / "schema.json"), prompt]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["text"] == one.text
    grammar = ["--grammar", str(tmp_path / "answer.gbnf"), "--grammar-dialect", "gbnf"]
    assert main(["generate", "--target", server.target, "--max-new-tokens", "8", *grammar, "Is the sky blue?"]) == 0
    assert re.fullmatch(r"(yes|no)!", capsys.readouterr().out.strip())
