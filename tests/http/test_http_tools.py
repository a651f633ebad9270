"""Tool calling end to end: the real SmolLM2 behind one server, driven by the official `openai` client.

Forced choices (``required``, a named function) give ``tool_calls`` whose arguments parse and match their tool's
schema, streamed or not; a follow-up with the assistant's calls and a ``role: tool`` result renders and answers;
``auto`` gives the same calls and content streamed as whole; bad tools are 400 naming the parameter.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from support.servers import tiny_settings

from service.api.server import BackgroundServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time at a UTC offset",
        "parameters": {
            "type": "object",
            "properties": {"offset": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["offset"],
        },
    },
}
TOOLS: list[Any] = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NEW = 96


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[BackgroundServer]:
    settings = tiny_settings(
        smollm2_dir, http_port=0, max_prompt_tokens=1536, max_total_tokens=2048, max_new_tokens=NEW, max_batch_size=4
    )
    with BackgroundServer(settings) as srv:
        yield srv


def check_calls(calls: list[Any] | None, names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """Each call has an id, a known name and arguments that parse and match that tool's schema."""
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    assert len({c.id for c in calls}) == len(calls)
    return out


def test_required_gives_valid_calls_of_the_tools(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=NEW
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, set(SCHEMAS))
    single = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=NEW,
    )  # fmt: skip
    assert len(check_calls(single.choices[0].message.tool_calls, set(SCHEMAS))) == 1
    sampled = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2,
        temperature=1.0, seed=7, max_tokens=NEW,
    )  # fmt: skip
    for choice in sampled.choices:  # sampled, each choice under the same schema (one call: a sampled list of calls
        # may go on until the token limit)
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls, set(SCHEMAS))


def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI, model: str) -> None:
    for name in SCHEMAS:
        reply = client.chat.completions.create(
            model=model, messages=QUESTION, tools=TOOLS, temperature=0.8, seed=3, max_tokens=NEW,
            tool_choice={"type": "function", "function": {"name": name}},
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "tool_calls"
        assert [n for n, _ in check_calls(reply.choices[0].message.tool_calls, {name})] == [name]


def test_a_follow_up_with_the_calls_and_their_results_answers(client: openai.OpenAI, model: str) -> None:
    first = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=NEW,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    message = first.choices[0].message
    assert message.tool_calls
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 22, "sky": "sunny"})}
        for call in message.tool_calls
    ]
    messages = [*QUESTION, message.model_dump(exclude_none=True), *results]
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=24
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content
    assert reply.usage is not None and reply.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """The content, ``(id, name, arguments)`` of each call, and the finish reason of one streamed reply."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                assert delta.function is not None
                entry = calls.setdefault(delta.index, ["", "", ""])
                entry[0] += delta.id or ""
                entry[1] += delta.function.name or ""
                entry[2] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), [tuple(calls[i]) for i in sorted(calls)], finish  # type: ignore[misc]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}, "auto"])
def test_streamed_calls_are_the_calls_of_the_whole_reply(client: openai.OpenAI, model: str, tool_choice: Any) -> None:
    ask = {"model": model, "messages": QUESTION, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 0,
           "max_tokens": NEW}  # fmt: skip
    whole = client.chat.completions.create(**ask).choices[0]
    content, calls, finish = streamed(client, **ask)
    assert finish == whole.finish_reason
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []]
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == expected
    assert all(call_id.startswith("call_") for call_id, _, _ in calls)
    assert content.strip() == (whole.message.content or "").strip()
    if tool_choice != "auto":
        assert finish == "tool_calls" and calls


def test_tool_choice_none_makes_no_calls(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=16
    )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason != "tool_calls"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),  # a schema the backend cannot compile
    ],
)
def test_bad_tools_are_refused_by_the_openai_client(
    client: openai.OpenAI, model: str, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, **kwargs)
    assert info.value.status_code == 400 and info.value.param == param  # type: ignore[attr-defined]
