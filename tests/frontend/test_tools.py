"""Tool calling without a model: the forced schema (checked with ``jsonschema`` against made-up outputs), the
Hermes parser on hand-written outputs, whole and streamed, and the chat turns each tool format renders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.frontend import tools
from service.frontend.prompts import prompt_of
from service.frontend.request import ChatMessage, Input
from service.frontend.tool_stream import CallStream
from service.frontend.tools import AUTO, NONE, REQUIRED, ToolCall, ToolSpec, ToolUse
from service.tokenizer import Tokenizer

WEATHER = ToolSpec(
    "get_weather",
    "The weather of a city",
    json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
)
TIME = ToolSpec("get_time", parameters=json.dumps({"type": "object", "properties": {"zone": {"type": "integer"}}}))
BOTH = (WEATHER, TIME)
EMPTY = tools.EMPTY_PARAMETERS
HERMES_TEMPLATE = (  # a Qwen2.5-like template: renders tools, tool calls and tool results itself
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def block(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def forced(use: ToolUse) -> dict[str, object]:
    constraint = use.constraint()
    assert constraint is not None and constraint.kind == "json_schema"
    schema: dict[str, object] = json.loads(constraint.source)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def test_required_forces_calls_of_known_tools_with_valid_arguments() -> None:
    schema = forced(ToolUse(BOTH, REQUIRED, parallel=True))
    good = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],  # no call
        [{"name": "get_weather", "arguments": {}}],  # a required argument missing
        [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "K"}}],  # not in the enum
        [{"name": "get_weather", "arguments": {"city": "Paris", "extra": 1}}],  # not allowed by the tool
        [{"name": "get_time", "arguments": {"zone": "utc"}}],  # wrong type
        [{"name": "launch", "arguments": {}}],  # no such tool
        [{"name": "get_time", "arguments": {}, "id": "x"}],  # a key besides name and arguments
        {"name": "get_time", "arguments": {}},  # not an array
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    calls = ToolUse(BOTH, REQUIRED).calls_of(json.dumps(good), tools.SMOLLM2)
    assert calls[0] is None and [(c.name, json.loads(c.arguments)) for c in calls[1]] == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("get_time", {}),
    ]
    assert all(c.id.startswith("call_") for c in calls[1]) and calls[1][0].id != calls[1][1].id


def test_required_without_parallel_calls_allows_exactly_one() -> None:
    schema = forced(ToolUse(BOTH, REQUIRED, parallel=False))
    one = [{"name": "get_time", "arguments": {"zone": 2}}]
    jsonschema.validate(one, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(one * 2, schema)


def test_a_named_tool_forces_its_arguments_alone() -> None:
    use = ToolUse(BOTH, "get_weather")
    schema = forced(use)
    jsonschema.validate({"city": "Oslo"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"zone": 1}, schema)
    content, calls = use.calls_of('{"city": "Oslo"}', tools.SMOLLM2)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_auto_and_none_force_nothing_and_a_cut_forced_output_stays_content() -> None:
    assert ToolUse(BOTH, AUTO).constraint() is None and ToolUse(BOTH, NONE).constraint() is None
    assert ToolUse(BOTH, REQUIRED).calls_of('[{"name": "get_ti', tools.SMOLLM2) == ('[{"name": "get_ti', ())
    text = block("get_time", {})
    assert ToolUse(BOTH, NONE).calls_of(text, tools.SMOLLM2) == (text, ())


@pytest.mark.parametrize(
    ("output", "content", "calls"),
    [
        ("Paris is sunny.", "Paris is sunny.", []),
        (block("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
        (
            "Let me check.\n" + block("get_weather", {"city": "Rome"}) + "\n" + block("get_time", {"zone": 1}),
            "Let me check.",
            [("get_weather", {"city": "Rome"}), ("get_time", {"zone": 1})],
        ),
        ('<tool_call>{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # left open at the end
        ('<tool_call>{"name": "get_time", "parameters": {"zone": 3}}</tool_call>', None, [("get_time", {"zone": 3})]),
        (
            '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": 3}"}</tool_call>',
            None,
            [("get_time", {"zone": 3})],
        ),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),  # invalid: stays content
        (block("launch", {}), block("launch", {}), []),  # an unknown tool: stays content
        ('<tool_call>["get_time"]</tool_call>', '<tool_call>["get_time"]</tool_call>', []),
        (  # SmolLM2's list of calls in one block
            'On it. <tool_call>[\n{"name": "get_time", "arguments": {"zone": 1}},\n'
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n]</tool_call>',
            "On it.",
            [("get_time", {"zone": 1}), ("get_weather", {"city": "Oslo"})],
        ),
        ("No tool fits. <tool_call>[]</tool_call>", "No tool fits.", []),  # the empty list: no call
        (  # one bad call in a list: the whole block stays content
            '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "launch", "arguments": {}}]</tool_call>',
            '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "launch", "arguments": {}}]</tool_call>',
            [],
        ),
        (
            '<tool_call>{"name": "get_time", "arguments": 3}</tool_call>',
            '<tool_call>{"name": "get_time", "arguments": 3}</tool_call>',
            [],
        ),
    ],
)
def test_auto_parses_hermes_blocks_of_hand_written_outputs(
    output: str, content: str | None, calls: list[tuple[str, object]]
) -> None:
    got_content, got = ToolUse(BOTH, AUTO).calls_of(output, tools.SMOLLM2)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_auto_without_parallel_calls_keeps_the_first() -> None:
    output = block("get_time", {}) + block("get_weather", {"city": "x"})
    _, calls = ToolUse(BOTH, AUTO, parallel=False).calls_of(output, tools.SMOLLM2)
    assert [c.name for c in calls] == ["get_time"]


def streamed(use: ToolUse, output: str, size: int) -> tuple[str, list[ToolCall]]:
    """The content and calls of ``output`` fed in pieces of ``size`` characters, each call put together from its
    deltas (the first has its id and name, each a piece of its arguments)."""
    stream = CallStream(use, tools.SMOLLM2)
    pieces = [output[i : i + size] for i in range(0, len(output), size)] or [""]
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for i, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, i == len(pieces) - 1)
        content.append(text)
        for d in deltas:
            assert bool(d.id) == (d.index not in calls) and bool(d.name) == bool(d.id)
            entry = calls.setdefault(d.index, [d.name, "", d.id])
            entry[1] += d.arguments
    assert stream.calls == len(calls) and sorted(calls) == list(range(len(calls)))
    return "".join(content), [ToolCall(*calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_outputs_give_the_calls_and_content_of_whole_ones(size: int) -> None:
    cases = [
        "Paris is sunny. <tool no",
        "Let me check.\n" + block("get_weather", {"city": "Rome"}) + "\n" + block("get_time", {"zone": 1}),
        "a <tool_call>{not json}</tool_call> b",
        '<tool_call>{"name": "get_time", "arguments": {}}',
        "x < y <tool",
        'a <tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {"zone": 1}}]'
        "</tool_call>",
        "None. <tool_call>[]</tool_call>",
    ]
    for output in cases:
        whole_content, whole = ToolUse(BOTH, AUTO).calls_of(output, tools.SMOLLM2)
        content, calls = streamed(ToolUse(BOTH, AUTO), output, size)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole]
        assert content.strip() == (whole_content or ""), output
    forced_output = '[{"name": "get_time", "arguments": {"zone": 2}}]'
    content, calls = streamed(ToolUse(BOTH, REQUIRED), forced_output, size)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": 2}')]
    named = ToolUse(BOTH, "get_weather")
    content, calls = streamed(named, '{"city": "Oslo", "unit": "C"}', size)  # its arguments, as they come
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo", "unit": "C"}')
    ]
    assert [c.arguments for c in named.calls_of('{"city": "Oslo", "unit": "C"}', tools.SMOLLM2)[1]] == [
        calls[0].arguments
    ]


def test_a_named_call_cut_short_is_not_complete() -> None:
    stream = CallStream(ToolUse(BOTH, "get_weather"), tools.SMOLLM2)
    assert stream.feed('{"city": "Os', False)[1][0].name == "get_weather"
    assert stream.feed("lo", True)[1][0].arguments == "lo" and not stream.complete
    whole = CallStream(ToolUse(BOTH, "get_weather"), tools.SMOLLM2)
    whole.feed('{"city": "Oslo"}', True)
    assert whole.complete and whole.calls == 1


def test_a_template_without_tools_gets_the_tool_block_and_calls_as_text(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer.from_folder(smollm2_dir)
    assert tools.format_for(tokenizer.chat_template) is tools.SMOLLM2
    call = ToolCall("get_weather", '{"city": "Paris"}', "call_1")
    messages = (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", (call,)),
        ChatMessage("tool", "22 C", tool_call_id="call_1"),
        ChatMessage("tool", "sunny", tool_call_id="call_1"),
    )
    text = prompt_of(Input(messages=messages, tools=BOTH), tokenizer).rendered
    system = tools.SMOLLM2_PROMPT.format(tools=json.dumps([WEATHER.as_openai(), TIME.as_openai()]))
    assert text.startswith(f"<|im_start|>system\n{system}\n\nBe brief.<|im_end|>\n")
    smol_call = '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>'
    assert f"<|im_start|>assistant\n{smol_call}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = prompt_of(Input(messages=messages[:2]), tokenizer).rendered
    assert "<tools>" not in plain


def test_a_template_that_renders_tools_gets_them_in_transformers_shape(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer.from_folder(smollm2_dir)
    tokenizer = Tokenizer(
        tokenizer._tk, special_tokens=tokenizer.special_tokens, eos_token_ids=tuple(tokenizer.eos_token_ids),
        chat_template=HERMES_TEMPLATE, name="hermes",
    )  # fmt: skip
    assert tools.format_for(tokenizer.chat_template) is tools.HERMES
    messages = (
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", "", (ToolCall("get_weather", '{"city": "Paris"}', "call_7"),)),
        ChatMessage("tool", "22 C", tool_call_id="call_7", name="get_weather"),
    )
    text = prompt_of(Input(messages=messages, tools=(WEATHER,)), tokenizer).rendered
    assert text == (
        f"<tools>{json.dumps(WEATHER.as_openai())}</tools>\n<user>Weather?"  # trim_blocks, as transformers
        '<assistant><tool_call>get_weather {"city": "Paris"}</tool_call><tool>22 C[call_7]<assistant>'
    )


def test_tools_and_calls_count_towards_the_prompt_bytes() -> None:
    from service.config import Settings
    from service.errors import InvalidRequest
    from service.frontend.checks import check_input

    settings = Settings(model=Path("unused"), max_prompt_bytes=4096)
    big = ToolSpec("big", "x" * 3000, EMPTY)
    question = (ChatMessage("user", "hi"),)
    check_input(Input(messages=question, tools=(big,)), settings)
    with pytest.raises(InvalidRequest, match="--max-prompt-bytes") as info:
        check_input(Input(messages=question, tools=(big, ToolSpec("b2", "y" * 1200, EMPTY))), settings)
    assert info.value.field == "input.messages"
    calls = (ChatMessage("assistant", "", (ToolCall("big", json.dumps({"a": "z" * 4100}), "c"),)),)
    with pytest.raises(InvalidRequest, match="--max-prompt-bytes"):
        check_input(Input(messages=question + calls), settings)


@pytest.mark.slow
def test_a_tools_template_renders_as_transformers_renders_it(smollm2_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = tmp_path / "hermes"
    folder.mkdir()
    shutil.copy(smollm2_dir / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    messages = (
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", "", (ToolCall("get_weather", '{"city": "Paris"}', "call_7"),)),
        ChatMessage("tool", "22 C", tool_call_id="call_7"),
    )
    hf_messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "22 C", "tool_call_id": "call_7"},
    ]  # fmt: skip
    ours = prompt_of(Input(messages=messages, tools=BOTH), Tokenizer.from_folder(folder)).rendered
    hf = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        hf_messages, tools=[t.as_openai() for t in BOTH], tokenize=False, add_generation_prompt=True
    )
    assert ours == hf


_PIECES = st.one_of(
    st.text(alphabet="ab <>/_tolcx{}\n", max_size=12),
    st.sampled_from(["<tool_call>", "</tool_call>", "<tool", "_call>", "[]", "{not json}", " \n "]),
    st.sampled_from(
        [
            block("get_time", {"zone": 1}),
            block("get_weather", {"city": "Oslo"}),
            block("launch", {}),
            '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {"zone": 2}}]'
            "</tool_call>",
        ]
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(_PIECES, max_size=8),
    cuts=st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=40),
    parallel=st.booleans(),
)
def test_any_output_streamed_in_any_pieces_gives_the_calls_and_content_of_the_whole(
    pieces: list[str], cuts: list[int], parallel: bool
) -> None:
    output = "".join(pieces)
    use = ToolUse(BOTH, AUTO, parallel=parallel)
    whole_content, whole = use.calls_of(output, tools.SMOLLM2)
    stream = CallStream(use, tools.SMOLLM2)
    content, calls, at = [], [], 0
    for i in range(len(cuts) + 1):
        size = cuts[i] if i < len(cuts) else len(output)
        final = i == len(cuts) or at + size >= len(output)
        text, deltas = stream.feed(output[at : at + size], final)
        content.append(text)
        calls += [(d.name, d.arguments) for d in deltas]
        at += size
        if final:
            break
    assert calls == [(c.name, c.arguments) for c in whole]
    assert "".join(content).strip() == (whole_content or "").strip()
