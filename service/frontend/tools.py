"""Tool calling, in no wire format: tool specs, the constraint that forces a call, the chat turns, the parsers.

A request's ``ToolUse`` carries its tools (``ToolSpec``: a name, a description and the JSON schema of the
arguments), its choice (``NONE``, ``AUTO``, ``REQUIRED`` or one tool's name) and whether several calls may be made
at once. ``AUTO`` generates freely and parses the tool-call blocks of the model's output; ``REQUIRED`` and a named
tool are generated under ``ToolUse.constraint``, a JSON schema whose every match is a valid call (``REQUIRED``:
an array of ``{"name", "arguments"}``; a named tool: its arguments object alone), so forced arguments always
parse and match their tool's schema. ``NONE`` neither forces nor parses (the tools stay in the prompt, as vLLM
keeps them).

How tools reach the prompt and how calls come back out depends on the chat template: ``FORMATS`` is a small table,
tried in order, of ``ToolFormat`` s. ``HERMES`` is for templates that render ``tools``, assistant ``tool_calls``
and ``role: tool`` messages themselves (Qwen2.5, Hermes 2/3): they get the conversation in transformers' shape.
``SMOLLM2`` is for templates that know nothing of tools, SmolLM2's among them: the server writes the tool prompt
into the system turn as SmolLM2 was taught it (``<tools>[...]</tools>``, calls as ``<tool_call>[{...}, ...]
</tool_call>``) and renders earlier calls and their results as text. Both parse ``<tool_call>`` blocks holding one
call object (Hermes) or a list of them (SmolLM2).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from service.constraints.spec import JSON_SCHEMA, Constraint

NONE, AUTO, REQUIRED = "none", "auto", "required"
EMPTY_PARAMETERS = '{"type":"object","properties":{}}'
MAX_TOOLS = 128
"""Tools in one request (docs/limits.md); their text also counts towards ``--max-prompt-bytes``."""


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: ``parameters`` is the JSON schema of its arguments, as JSON text."""

    name: str
    description: str = ""
    parameters: str = EMPTY_PARAMETERS

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI / transformers shape: what chat templates receive as ``tools``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made (or an assistant turn carries): ``arguments`` is a JSON object, as JSON text."""

    name: str
    arguments: str
    id: str = ""


class ChatMessage(Protocol):
    """What is read of a chat turn here (``service.frontend.request.ChatMessage``, which imports this module)."""

    @property
    def role(self) -> str: ...
    @property
    def content(self) -> str: ...
    @property
    def tool_calls(self) -> tuple[ToolCall, ...]: ...
    @property
    def tool_call_id(self) -> str: ...
    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and how they may be used: ``choice`` is ``NONE``, ``AUTO``, ``REQUIRED`` or a tool's
    name; ``parallel``: more than one call per reply."""

    tools: tuple[ToolSpec, ...]
    choice: str = AUTO
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice not in (NONE, AUTO)

    def tool(self, name: str) -> ToolSpec | None:
        return next((t for t in self.tools if t.name == name), None)

    def constraint(self) -> Constraint | None:
        """The JSON schema a forced choice is generated under (None: free text)."""
        if not self.forced:
            return None
        return Constraint(JSON_SCHEMA, json.dumps(forced_schema(self), separators=(",", ":"), ensure_ascii=False))

    def calls_of(self, text: str, fmt: ToolFormat) -> tuple[str | None, tuple[ToolCall, ...]]:
        """A whole output -> ``(content, calls)``: the forced JSON, or ``fmt``'s blocks under ``AUTO``. An output
        that is no call (cut by the token limit, free text) stays content."""
        if self.choice == NONE:
            return text, ()
        if self.forced:
            calls = parse_forced(self, text)
            return (text, ()) if calls is None else (None, calls)
        content, calls = fmt.parse(text, self)
        return content, calls if self.parallel else calls[:1]


def forced_schema(use: ToolUse) -> dict[str, Any]:
    """``REQUIRED``: ``[{"name": <a tool>, "arguments": <its schema>}, ...]`` (one item unless parallel); a named
    tool: its arguments schema alone."""
    if use.choice != REQUIRED:
        spec = use.tool(use.choice)
        if spec is None:
            raise ValueError(f"no tool named {use.choice!r}")
        return dict(json.loads(spec.parameters))
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": json.loads(t.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in use.tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": options}, "minItems": 1}
    if not use.parallel:
        schema["maxItems"] = 1
    return schema


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_forced(use: ToolUse, text: str) -> tuple[ToolCall, ...] | None:
    """The calls of an output generated under ``use.constraint()``; None when it is not one (cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if use.choice != REQUIRED:
        # the model's own text, as a stream sends it piece by piece
        return (ToolCall(use.choice, text.strip(), new_call_id()),) if isinstance(value, dict) else None
    if not isinstance(value, list) or not value:
        return None
    return _calls_of(value, use)


def _calls_of(items: Sequence[object], use: ToolUse | None) -> tuple[ToolCall, ...] | None:
    """Every item as a call (``_call_of``), or None if any is not one."""
    calls = [_call_of(item, use) for item in items]
    return None if any(c is None for c in calls) else tuple(c for c in calls if c is not None)


def _call_of(value: object, use: ToolUse | None) -> ToolCall | None:
    """``{"name": str, "arguments": object}`` (or ``"parameters"``, or the arguments as JSON text) -> a call of a
    tool ``use`` has; None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict) or (use is not None and use.tool(value["name"]) is None):
        return None
    return ToolCall(value["name"], _json(arguments), new_call_id())


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---- <tool_call> blocks: one call each (Hermes), or a list of calls (SmolLM2) ----------------------------------------

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_blocks(text: str, use: ToolUse | None) -> tuple[str | None, tuple[ToolCall, ...]]:
    """``(content, calls)`` of an output: each ``<tool_call>`` block (the last may be left open at the end) holding
    valid calls of known tools gives its calls and leaves the content (an empty list: no call); any other block
    stays content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for match in _BLOCK.finditer(text):
        found = block_calls(match.group(1), use)
        if found is None:
            continue
        kept.append(text[at : match.start()])
        at = match.end()
        while at < len(text) and text[at].isspace():  # the whitespace after a call goes with it (as streamed)
            at += 1
        calls += found
    if not at:
        return text, ()
    kept.append(text[at:])
    content = "".join(kept).strip()
    return (content or None) if calls else content, tuple(calls)


def block_calls(body: str, use: ToolUse | None) -> tuple[ToolCall, ...] | None:
    """The calls of one block's JSON: a call object (Hermes) or a list of them (SmolLM2); None when it holds
    anything else, or a call of a tool ``use`` does not have."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _calls_of(value if isinstance(value, list) else [value], use)


def _call_json(call: ToolCall) -> str:
    return _json({"name": call.name, "arguments": _object(call.arguments)})


def hermes_block(call: ToolCall) -> str:
    return f"{CALL_OPEN}\n{_call_json(call)}\n{CALL_CLOSE}"


def smollm2_block(calls: Sequence[ToolCall]) -> str:
    return CALL_OPEN + "[\n" + ",\n".join(_call_json(c) for c in calls) + "\n]" + CALL_CLOSE


SMOLLM2_PROMPT = """You can compose function calls. Given a question and the functions below, make one or more \
function calls that achieve its purpose. If no function fits, say so and do not answer; if the question lacks a \
parameter a function requires, say so too.
You have access to the following tools:
<tools>{tools}</tools>
To call functions, reply in exactly this format and with nothing else, each argument of its parameter's type \
(if no call is needed, give the empty list []):
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
(more tool calls as required)
]</tool_call>"""


def _template_turns(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """transformers' shape: assistant ``tool_calls`` with their arguments as objects, ``tool_call_id`` on tool
    results (templates such as Qwen2.5's render both themselves)."""
    turns: list[dict[str, Any]] = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _object(c.arguments)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        if m.name:
            turn["name"] = m.name
        turns.append(turn)
    return turns


def _smollm2_turns(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """For a template that knows no tools, as SmolLM2 was taught them: the tool prompt leads the system turn, an
    assistant's calls are written as one ``<tool_call>[...]</tool_call>`` block after its text, and each run of
    tool results becomes one user turn of ``<tool_response>`` blocks."""
    turns: list[dict[str, Any]] = []
    results = False  # the last turn holds tool results
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if results:
                turns[-1]["content"] += "\n" + block
            else:
                turns.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        content = m.content
        if m.tool_calls:
            content = f"{content}\n{smollm2_block(m.tool_calls)}" if content else smollm2_block(m.tool_calls)
        turns.append({"role": m.role, "content": content})
    if tools:
        block = SMOLLM2_PROMPT.format(tools=_json([t.as_openai() for t in tools]))
        if turns and turns[0]["role"] == "system":
            first = turns[0]["content"]
            turns[0]["content"] = f"{block}\n\n{first}" if first else block
        else:
            turns.insert(0, {"role": "system", "content": block})
    return turns


def _object(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


@dataclass(frozen=True)
class ToolFormat:
    """How one family of chat templates takes tools and gives calls back. ``fits(template source)`` picks it;
    ``turns(messages, tools)`` the conversation for the template and ``renders_tools`` whether the template also
    gets ``tools``; ``parse(output, use)`` ``(content, calls)``."""

    name: str
    fits: Callable[[str], bool]
    renders_tools: bool
    turns: Callable[[Sequence[ChatMessage], Sequence[ToolSpec]], list[dict[str, Any]]] = field(repr=False)
    parse: Callable[[str, ToolUse | None], tuple[str | None, tuple[ToolCall, ...]]] = field(repr=False)

    def render_args(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """``(messages, extra template variables)`` for ``Tokenizer.apply_chat_template``."""
        extra = {"tools": [t.as_openai() for t in tools]} if self.renders_tools and tools else {}
        return self.turns(messages, tools), extra


_RENDERS_TOOLS = re.compile(r"\btools\b")

HERMES = ToolFormat(
    "hermes", lambda template: bool(_RENDERS_TOOLS.search(template)), True,
    lambda messages, _tools: _template_turns(messages), parse_blocks,
)  # fmt: skip
SMOLLM2 = ToolFormat("smollm2", lambda _template: True, False, _smollm2_turns, parse_blocks)
FORMATS: tuple[ToolFormat, ...] = (HERMES, SMOLLM2)
"""Tried in order; the last fits every template."""


def format_for(template: str | None) -> ToolFormat:
    """The tool format of a chat template (its source text)."""
    source = template or ""
    return next(f for f in FORMATS if f.fits(source))


def uses_tools(messages: Sequence[ChatMessage] | None, tools: Sequence[ToolSpec]) -> bool:
    """Whether a conversation needs a tool format to render (tools given, or tool calls or results in it)."""
    return bool(tools) or any(m.tool_calls or m.role == "tool" for m in messages or ())


def tool_texts(tools: Sequence[ToolSpec], messages: Sequence[ChatMessage] | None) -> list[str]:
    """The texts of the tools and of the messages' calls: what counts towards the prompt's size beyond content."""
    texts = [s for t in tools for s in (t.name, t.description, t.parameters)]
    texts += [s for m in messages or () for c in m.tool_calls for s in (c.name, c.arguments, c.id)]
    return texts + [s for m in messages or () for s in (m.tool_call_id, m.name) if s]
