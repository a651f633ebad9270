"""Tool calling's OpenAI parameters -> the domain call, without a server: what is built, and what is refused
(400, ``param`` the OpenAI parameter) before any work."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.api.http import params
from service.api.http.errors import error_body
from service.constraints.spec import ConstraintLimits
from service.errors import InvalidRequest, LoraplexError
from service.frontend.tools import AUTO, MAX_TOOLS, REQUIRED, ToolCall

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": True,
    },
}
USER = {"role": "user", "content": "Weather in Paris?"}


def parse(body: dict[str, Any], kind: params.Kind = "chat", limits: ConstraintLimits | None = None) -> params.Call:
    base: dict[str, Any] = {"model": "m", "messages": [USER]} if kind == "chat" else {"model": "m", "prompt": "x"}
    return params.parse(
        kind, {**base, **body}, request_id="r", adapter_of=lambda _: "", constraint_limits=limits or ConstraintLimits()
    )


def test_tools_and_each_choice_become_a_tool_use() -> None:
    call = parse({"tools": [WEATHER]})
    assert call.tools is not None and call.tools.choice == AUTO and call.tools.parallel
    assert call.request.constraint is None
    spec = call.tools.tools[0]
    assert (spec.name, spec.description, json.loads(spec.parameters)) == (
        "get_weather",
        "The weather of a city",
        WEATHER["function"]["parameters"],
    )
    assert call.request.inputs[0].tools == call.tools.tools
    assert parse({"tools": [WEATHER], "tool_choice": "none"}).request.constraint is None
    required = parse({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    assert required.tools is not None and required.tools.choice == REQUIRED and not required.tools.parallel
    assert required.request.constraint is not None and json.loads(required.request.constraint.source)["maxItems"] == 1
    named = parse({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.request.constraint is not None
    assert json.loads(named.request.constraint.source) == WEATHER["function"]["parameters"]
    bare = parse({"tools": [{"type": "function", "function": {"name": "ping"}}], "tool_choice": "required"})
    assert bare.tools is not None and json.loads(bare.tools.tools[0].parameters) == {"type": "object", "properties": {}}
    assert parse({"tool_choice": "none"}).tools is None and parse({"tools": []}).tools is None
    assert parse({"parallel_tool_calls": True}).tools is None


def test_assistant_tool_calls_and_tool_results_become_chat_messages() -> None:
    call = parse(
        {
            "tools": [WEATHER],
            "messages": [
                USER,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
            ],
        }
    )  # fmt: skip
    messages = call.request.inputs[0].messages
    assert messages is not None
    assert messages[1].content == "" and messages[1].tool_calls == (
        ToolCall("get_weather", '{"city": "Paris"}', "call_1"),
    )
    assert (messages[2].role, messages[2].content, messages[2].tool_call_id) == ("tool", "22 C", "call_1")


def tool(**function: object) -> dict[str, object]:
    return {"type": "function", "function": function}


TOO_BIG = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 64} for i in range(40)}}
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": {"type": "function"}}, "tools", "must be an array"),
    ({"tools": ["f"]}, "tools", "type 'function'"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "type 'function'"),
    ({"tools": [{"type": "function"}]}, "tools", "function must be an object"),
    ({"tools": [tool(description="no name")]}, "tools", "function.name"),
    ({"tools": [tool(name="has space")]}, "tools", "function.name"),
    ({"tools": [tool(name="f", parameters=[1])]}, "tools", "parameters must be a JSON schema object"),
    ({"tools": [tool(name="f", parameters="{}")]}, "tools", "parameters must be a JSON schema object"),
    ({"tools": [tool(name="f", made_up=1)]}, "tools", "function.'made_up'"),
    ({"tools": [tool(name="f", **{"x" * 5000: 1})]}, "tools", "more characters"),  # echoed input is cut
    ({"tools": [tool(name="f"), tool(name="f")]}, "tools", "same name"),
    ({"tools": [tool(name=f"f{i}") for i in range(MAX_TOOLS + 1)]}, "tools", f"at most {MAX_TOOLS}"),
    ({"tools": [tool(name="f", parameters=TOO_BIG)], "tool_choice": "required"}, "tools", "--max-constraint-bytes"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "'none', 'auto', 'required'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not one of the tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "n" * 5000}}}, "tool_choice",
     "more characters"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "tools is empty"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot also match response_format"),
    ({"messages": [USER, {"role": "tool", "content": "x"}]}, "messages[1]", "needs tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, "messages[0]", "only allowed on assistant"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     "messages[1]", None),  # arguments default to {}: accepted
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
     "messages[1]", "arguments (a JSON string)"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0]", "only allowed on tool"),
    ({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, "messages[0]", "participant names"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "fragment"), BAD)
def test_bad_tool_inputs_are_400_naming_the_parameter(body: dict[str, Any], param: str, fragment: str | None) -> None:
    limits = ConstraintLimits(max_bytes=2048)
    if fragment is None:
        parse(body, limits=limits)
        return
    with pytest.raises(LoraplexError) as info:
        parse(body, limits=limits)
    error = error_body(info.value, chat=True)["error"]
    assert isinstance(info.value, InvalidRequest) or error["code"] == "unsupported_parameter"
    assert error["param"] == param and fragment in error["message"], error


def test_completions_refuse_tools_by_name() -> None:
    with pytest.raises(LoraplexError) as info:
        parse({"tools": [WEATHER]}, kind="completions")
    assert error_body(info.value, chat=False)["error"]["code"] == "unsupported_parameter"
    assert parse({"tool_choice": None}, kind="completions").tools is None  # ... unless null
