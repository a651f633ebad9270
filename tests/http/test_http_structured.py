"""Structured outputs end to end over loopback HTTP, on the real SmolLM2 model: every spelling of a constraint
(``response_format``, vLLM's ``structured_outputs`` and ``guided_*``) through the official `openai` client, on chat
and completions, streamed and not. Outputs that finish are valid (``jsonschema``, ``re.fullmatch``, one of the
choices); a stream gives the non-streamed text (greedy); a cut output is a prefix of the whole one, finished with
``length``; constraints the backend refuses are 400 naming the field they came in."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
from support.http_api import base_url, call, sse_events
from support.paths import ROOT
from support.servers import tiny_settings

from service.api.server import BackgroundServer

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"\d{3}-\d{4}"
COLOURS = ["red", "green", "blue"]
GBNF = 'root ::= "The answer is " ("yes" | "no") "."\n'
LARK = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"\n'
ANSWER = re.compile(r"The answer is (yes|no)\.")
ASK = [{"role": "user", "content": "Give me the name and age of a famous scientist."}]


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[BackgroundServer]:
    demo = ROOT / "adapters" / "demo"
    with BackgroundServer(tiny_settings(smollm2_dir, http_port=0, max_new_tokens=96, adapter_dirs=(demo,))) as srv:
        yield srv


def chat(client: openai.OpenAI, model: str, **kw: Any) -> Any:
    """A greedy chat call (``ASK`` unless ``messages`` is given) with ``kw``."""
    kw = {"messages": ASK, "temperature": 0, "max_tokens": 64, **kw}
    return client.chat.completions.create(model=model, **kw)


def test_response_format_json_schema_gives_valid_json(client: openai.OpenAI, model: str) -> None:
    for strict in (True, False):
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}
        reply = chat(client, model, response_format=fmt)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


def test_the_clients_parse_helper_gets_its_pydantic_model(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.parse(
        model=model, messages=ASK, temperature=0, max_tokens=64, response_format=Person
    )  # type: ignore[arg-type]
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Person) and reply.choices[0].finish_reason == "stop"


def test_json_object_on_both_routes(client: openai.OpenAI, model: str) -> None:
    capital = [{"role": "user", "content": "Reply in JSON: what is the capital of France?"}]
    reply = chat(client, model, response_format={"type": "json_object"}, messages=capital)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    text = client.completions.create(
        model=model, prompt="A JSON object describing a cat:", temperature=0, max_tokens=64,
        extra_body={"structured_outputs": {"json_object": True}},
    )  # fmt: skip
    assert text.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text.choices[0].text), dict)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": PHONE}}, lambda t: re.fullmatch(PHONE, t)),
        ({"guided_regex": PHONE}, lambda t: re.fullmatch(PHONE, t)),
        ({"structured_outputs": {"choice": COLOURS}}, lambda t: t in COLOURS),
        ({"guided_choice": COLOURS}, lambda t: t in COLOURS),
        ({"structured_outputs": {"grammar": GBNF}}, lambda t: ANSWER.fullmatch(t)),
        ({"structured_outputs": {"grammar": LARK}}, lambda t: ANSWER.fullmatch(t)),
        ({"guided_grammar": GBNF}, lambda t: ANSWER.fullmatch(t)),
        ({"structured_outputs": {"json": json.dumps(PERSON)}}, lambda t: jsonschema.validate(json.loads(t), PERSON)
         is None),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ],
)  # fmt: skip
def test_vllm_spellings_constrain_chat_and_completions(
    client: openai.OpenAI, model: str, extra: dict[str, Any], check: Any
) -> None:
    reply = chat(client, model, extra_body=extra)
    assert reply.choices[0].finish_reason == "stop", reply.choices[0]
    assert check(reply.choices[0].message.content), reply.choices[0].message.content
    text = client.completions.create(model=model, prompt="Answer:", temperature=0, max_tokens=64, extra_body=extra)
    assert text.choices[0].finish_reason == "stop", text.choices[0]
    assert check(text.choices[0].text), text.choices[0].text


def test_sampled_choices_all_match(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=ASK, temperature=1.0, seed=7, n=3, max_tokens=64,
        extra_body={"structured_outputs": {"regex": PHONE}},
    )  # fmt: skip
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(PHONE, choice.message.content), choice


def test_streamed_choices_and_adapters_are_constrained(client: openai.OpenAI, model: str) -> None:
    texts: dict[int, str] = {}
    for chunk in chat(client, model, temperature=1.0, seed=3, n=2, stream=True, extra_body={"guided_regex": PHONE}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(texts) == [0, 1] and all(re.fullmatch(PHONE, t) for t in texts.values()), texts
    for adapter in ("caps", "terse"):
        reply = chat(client, adapter, extra_body={"structured_outputs": {"choice": COLOURS}})
        assert reply.choices[0].message.content in COLOURS and reply.choices[0].finish_reason == "stop"
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        reply = chat(client, adapter, response_format=fmt)
        assert reply.choices[0].finish_reason == "stop", (adapter, reply.choices[0])
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
        {"structured_outputs": {"regex": PHONE}},
        {"guided_choice": COLOURS},
    ],
)
def test_a_stream_gives_the_whole_reply(client: openai.OpenAI, model: str, extra: dict[str, Any]) -> None:
    whole = chat(client, model, **_spelled(extra))
    parts, finish = [], None
    for chunk in chat(client, model, stream=True, **_spelled(extra)):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason == "stop"
    # the client's completions.create has no response_format argument: vLLM's extension body carries it
    text = client.completions.create(model=model, prompt="Answer:", temperature=0, max_tokens=64, extra_body=extra)
    streamed = client.completions.create(
        model=model, prompt="Answer:", temperature=0, max_tokens=64, stream=True, extra_body=extra
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text.choices[0].text


def _spelled(extra: dict[str, Any]) -> dict[str, Any]:
    """``response_format`` as the client's own argument, anything else in ``extra_body``."""
    return dict(extra) if "response_format" in extra else {"extra_body": extra}


def test_a_cut_output_is_a_prefix_finished_by_length(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = chat(client, model, response_format=fmt).choices[0].message.content
    cut = chat(client, model, response_format=fmt, max_tokens=3).choices[0]
    assert cut.finish_reason == "length"
    assert whole.startswith(cut.message.content) and cut.message.content != whole
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.message.content)


REFUSED = [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"guided_regex": "(?=x)a"}, "guided_regex"),  # look-around: not in the backend's regex syntax
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= (("}}, "structured_outputs.grammar"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), REFUSED)
@pytest.mark.parametrize("stream", [False, True])
def test_constraints_the_backend_refuses_are_400_naming_the_field(
    server: BackgroundServer, model: str, extra: dict[str, Any], param: str, stream: bool
) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": 4, "stream": stream, **extra}
    reply = call(f"{base_url(server)}/completions", body)
    assert reply.status == 400, reply.body
    error = reply.body["error"]
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", "invalid_request"), error
    assert error["message"] and len(error["message"]) < 4096


def test_a_long_refused_constraint_gets_a_short_message(server: BackgroundServer, model: str) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": 4, "guided_regex": "(" + "a" * 60_000}
    reply = call(f"{base_url(server)}/completions", body)
    assert reply.status == 400 and reply.body["error"]["param"] == "guided_regex"
    assert len(reply.body["error"]["message"]) < 4096


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("extra", "param", "flag"),
    [
        ({"guided_choice": [f"c{i}" for i in range(1025)]}, "guided_choice", "--max-constraint-choices"),
        ({"structured_outputs": {"regex": "a" * 65537}}, "structured_outputs.regex", "--max-constraint-bytes"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": _nested(40)}}},
         "response_format.json_schema.schema", "--max-constraint-depth"),
    ],
)  # fmt: skip
def test_constraints_over_a_limit_are_400_naming_the_field_and_the_flag(
    server: BackgroundServer, model: str, extra: dict[str, Any], param: str, flag: str
) -> None:
    body = {"model": model, "messages": ASK, "max_tokens": 4, **extra}
    reply = call(f"{base_url(server)}/chat/completions", body)
    assert reply.status == 400, reply.body
    error = reply.body["error"]
    assert error["param"] == param and flag in error["message"], error


def test_the_openai_client_sees_a_refused_constraint_as_bad_request(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, model, extra_body={"structured_outputs": {"regex": "(", "choice": ["a"]}})
    assert bad.value.param == "structured_outputs.choice"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as bad:
        chat(
            client, model, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
        )
    assert bad.value.param == "response_format.json_schema.schema"  # type: ignore[attr-defined]


def test_raw_sse_of_a_constrained_stream(server: BackgroundServer, model: str) -> None:
    body = {"model": model, "messages": ASK, "max_tokens": 32, "temperature": 0, "stream": True,
            "guided_choice": COLOURS, "stream_options": {"include_usage": True}}  # fmt: skip
    reply = call(f"{base_url(server)}/chat/completions", body)
    assert reply.status == 200
    events = sse_events(reply.body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text in COLOURS
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and set(finishes[:-1]) <= {None}
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
