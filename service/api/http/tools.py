"""OpenAI's tool calling on the wire: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and the messages'
``tool_calls`` / ``tool_call_id`` in, ``message.tool_calls`` and their stream deltas out.

The request side builds a ``ToolUse`` (``service.frontend.tools``) and refuses bad input with ``InvalidRequest``
naming the OpenAI parameter; a forced choice's schema is bounded by ``--max-constraint-bytes`` here, so its error
names ``tools``. The reply side turns the parsed calls into OpenAI's objects (ids ``call_<hex>``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from service.api.http.structured import Structured
from service.constraints.spec import ConstraintLimits, check_constraint
from service.errors import InvalidRequest, UnsupportedParameter, echo
from service.frontend.request import ChatMessage
from service.frontend.tool_stream import CallDelta
from service.frontend.tools import AUTO, MAX_TOOLS, NONE, REQUIRED, ToolCall, ToolSpec, ToolUse, new_call_id

PARAMS = ("tools", "tool_choice", "parallel_tool_calls")
MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")
"""Message fields besides role and content that tool calling adds."""

_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def tool_use(given: Mapping[str, Any]) -> ToolUse | None:
    """The request's tools and choice (None: no ``tools``)."""
    tools = given.get("tools")
    choice = given.get("tool_choice")
    parallel = given.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be true or false", field="parallel_tool_calls")
    if tools is None:
        if choice is not None and choice != NONE:
            raise InvalidRequest("tool_choice is only allowed when tools are given", field="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be an array of {type: function, function: {...}} objects", field="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(
            f"tools has {len(tools)} entries; this server accepts at most {MAX_TOOLS}", field="tools", limit=MAX_TOOLS
        )
    specs = tuple(_spec(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools has two functions of the same name", field="tools")
    use = ToolUse(specs, _choice(choice, specs), parallel)
    if not specs and use.choice != NONE:  # OpenAI's answer to an empty list: no tools to choose from
        if use.forced:
            raise InvalidRequest("tool_choice forces a call, but tools is empty", field="tool_choice")
        return None
    return use


def _spec(tool: object, where: str) -> ToolSpec:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidRequest(f"{where} must be an object with type 'function'", field="tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest(f"{where}.function must be an object with a name", field="tools")
    extra = [("", k) for k in sorted(set(tool) - {"type", "function"})]
    extra += [("function.", k) for k in sorted(set(function) - _FUNCTION_KEYS)]
    if extra:
        at, key = extra[0]
        raise InvalidRequest(f"{where}.{at}{echo(key)} is not a field of an OpenAI tool", field="tools")
    name = function.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-." for c in name):
        raise InvalidRequest(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'", field="tools")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequest(f"{where}.function.description must be a string", field="tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object", field="tools")
    if function.get("strict") not in (None, True, False):
        raise InvalidRequest(f"{where}.function.strict must be true or false", field="tools")
    return ToolSpec(name, description, json.dumps(parameters, ensure_ascii=False, separators=(",", ":")))


def _choice(choice: object, specs: tuple[ToolSpec, ...]) -> str:
    if choice is None:
        return AUTO
    if choice in (NONE, AUTO, REQUIRED):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if isinstance(name, str) and any(s.name == name for s in specs):
            return name
        raise InvalidRequest(f"tool_choice names {echo(name)}, which is not one of the tools", field="tool_choice")
    raise InvalidRequest(
        "tool_choice must be 'none', 'auto', 'required' or {type: function, function: {name}}", field="tool_choice"
    )


def chat_message(role: str, content: str, message: Mapping[str, Any], where: str) -> ChatMessage:
    """A chat message with its tool fields: an assistant's ``tool_calls``, a tool result's ``tool_call_id``."""
    calls = message.get("tool_calls") or []
    call_id = message.get("tool_call_id") or ""
    name = message.get("name") or ""
    if calls and role != "assistant":
        raise InvalidRequest(f"{where}.tool_calls is only allowed on assistant messages", field=where)
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where}.tool_calls must be an array", field=where)
    if role == "tool" and not (isinstance(call_id, str) and call_id):
        raise InvalidRequest(f"{where} is a tool result: it needs tool_call_id", field=where)
    if call_id and role != "tool":
        raise InvalidRequest(f"{where}.tool_call_id is only allowed on tool messages", field=where)
    if name and not isinstance(name, str):
        raise InvalidRequest(f"{where}.name must be a string", field=where)
    if name and role != "tool":
        raise UnsupportedParameter(f"{where}.name is not supported (participant names)", field=where)
    return ChatMessage(role, content, tuple(_call(c, f"{where}.tool_calls[{j}]", where) for j, c in enumerate(calls)),
                       call_id, name)  # fmt: skip


def _call(call: object, where: str, field: str) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
        raise InvalidRequest(f"{where} must be {{type: function, id, function: {{name, arguments}}}}", field=field)
    name, arguments, call_id = function.get("name"), function.get("arguments", "{}"), call.get("id", "")
    if not isinstance(name, str) or not name or not isinstance(arguments, str) or not isinstance(call_id, str):
        raise InvalidRequest(f"{where}.function needs a name and arguments (a JSON string)", field=field)
    return ToolCall(name, arguments, call_id)


def with_structured(use: ToolUse | None, output: Structured, limits: ConstraintLimits | None) -> Structured:
    """The request's one output constraint: a forced call's schema (bounded by ``limits`` here, so its errors are
    about ``tools``), else the structured output's. Both at once is refused: the output cannot be a call and match
    another schema."""
    constraint = None if use is None else use.constraint()
    if use is None or constraint is None:
        return output
    if output.constraint is not None:
        raise InvalidRequest(
            f"tool_choice {use.choice!r} forces a tool call, which cannot also match {output.param}: give one of them",
            field="tool_choice",
        )
    if limits is not None:
        try:
            check_constraint(constraint, limits)
        except InvalidRequest as exc:
            raise InvalidRequest(
                f"the schema that forces a call of these tools is too large: {exc}", field="tools", limit=exc.limit
            ) from None
    return Structured(constraint, "tools")


# ---- replies ------------------------------------------------------------------------------------------------------


def tool_calls_json(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a reply."""
    return [
        {"id": c.id or new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def tool_call_deltas(deltas: tuple[CallDelta, ...]) -> list[dict[str, Any]]:
    """``delta.tool_calls`` of a stream chunk, as vLLM's: a call's first piece has ``index``, ``id``, ``type`` and
    ``function.name``; every piece ``index`` and ``function.arguments``."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if d.id:
            out.append({"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}})  # fmt: skip
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out
