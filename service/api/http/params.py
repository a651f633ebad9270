"""OpenAI request bodies -> the frontend's domain call, every parameter accounted for.

A body becomes one ``GenerationCall`` (choice ``j`` of prompt ``p`` is input ``p * n + j``, seeded with seed + that
index, as the frontend seeds a call's inputs), so the HTTP API runs the same checks (``service.frontend.checks``)
and the same generation path as gRPC. This module only checks what JSON can get wrong and the domain types
cannot hold (types, negative integers, mutually exclusive fields); ranges stay with the shared checks.

Every top-level name is one of: supported (``_CHAT`` / ``_COMPLETIONS``), known but unsupported (``UNSUPPORTED``:
refused by name with ``unsupported_parameter``, unless the value is null or the parameter's no-op value), or
unknown (refused with ``unknown_parameter``). Nothing is ignored silently. Errors are ``InvalidRequest`` whose
``field`` is the OpenAI parameter name.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from service.api.http import structured, tools
from service.constraints.spec import ConstraintLimits
from service.errors import InvalidRequest, UnknownParameter, UnsupportedParameter
from service.frontend import GenerationCall, Input, Sampling
from service.frontend.tools import ToolUse

Kind = Literal["chat", "completions"]

UNSUPPORTED: Mapping[str, str] = {
    "tools": "tool calling on /v1/completions (/v1/chat/completions has it)",
    "tool_choice": "tool calling on /v1/completions (/v1/chat/completions has it)",
    "parallel_tool_calls": "tool calling on /v1/completions (/v1/chat/completions has it)",
    "functions": "function calling",
    "function_call": "function calling",
    "logit_bias": "logit bias",
    "frequency_penalty": "frequency penalties (repetition_penalty is)",
    "presence_penalty": "presence penalties (repetition_penalty is)",
    "audio": "audio output",
    "modalities": "modalities other than text",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning effort",
    "verbosity": "verbosity",
    "web_search_options": "web search",
    "service_tier": "service tiers",
    "store": "stored completions",
    "metadata": "stored-completion metadata",
    "prompt_cache_key": "prompt cache keys (prefix caching is automatic)",
    "safety_identifier": "safety identifiers",
    "best_of": "best_of (n is)",
    "echo": "echo",
    "suffix": "suffix (insertion)",
}
"""OpenAI parameters this server knows and refuses, with what is not supported."""

NO_OP: Mapping[str, object] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "store": False,
    "echo": False,
    "best_of": 1,
}
"""Values of unsupported parameters that change nothing: accepted (so are nulls)."""


@dataclass(frozen=True)
class Call:
    """One checked OpenAI request: what to generate (``request``) and how to answer."""

    kind: Kind
    model: str
    request: GenerationCall
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    constraint_param: str | None = None  # the parameter the output constraint came from (its errors' param)
    tools: ToolUse | None = None  # chat only: the request's tools (``service.api.http.tools``)

    @property
    def choices(self) -> int:
        return len(self.request.inputs)

    def choice(self, index: int) -> GenerationCall:
        """Choice ``index`` as a call of its own (streamed), seeded as input ``index`` of ``request`` is."""
        r = self.request
        seed = None if r.sampling.seed is None else (r.sampling.seed + index) % 2**64
        several = self.choices > 1 and len(r.request_id) < 120
        return replace(
            r,
            inputs=(r.inputs[index],),
            sampling=replace(r.sampling, seed=seed),
            request_id=f"{r.request_id}/{index}" if several else r.request_id,
        )


def parse(
    kind: Kind,
    body: object,
    *,
    request_id: str,
    adapter_of: Callable[[str], str],
    constraint_limits: ConstraintLimits | None = None,
) -> Call:
    """Check ``body`` (a parsed JSON value) and build its ``Call``. ``adapter_of(model)`` is the adapter id for a
    ``model`` name ("" = the base model) or raises ``AdapterNotFound``; ``constraint_limits`` bound the schema of a
    forced tool call."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", field=None)
    known = _CHAT if kind == "chat" else _COMPLETIONS
    given = {k: v for k, v in body.items() if v is not None}
    for name, value in given.items():
        if name in known:
            continue
        if name in UNSUPPORTED:
            if name in NO_OP and value == NO_OP[name]:
                continue
            raise UnsupportedParameter(
                f"{name!r} is not supported: this server does not do {UNSUPPORTED[name]}", field=name
            )
        raise UnknownParameter(f"unknown parameter {name!r}", field=name)
    model = _string(given, "model", required=True)
    adapter_id = adapter_of(model)
    n = _integer(given, "n", 1, lowest=1)
    use = tools.tool_use(given) if kind == "chat" else None
    inputs = _chat_inputs(given, use) if kind == "chat" else _text_inputs(given)
    sampling = _sampling(given)
    max_new_tokens, stops, ignore_eos = _stopping(given)
    scale, mixture = _adapters(given)
    logprobs = _logprobs(kind, given)
    output = tools.with_structured(use, structured.parse(given), constraint_limits)  # or response_format, guided_*
    request = GenerationCall(
        inputs=tuple(item for item in inputs for _ in range(n)),
        adapter_id=adapter_id,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        stop_sequences=stops,
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        request_id=request_id,
        constraint=output.constraint,
        adapter_scale=scale,
        adapters=mixture,
    )
    stream = _boolean(given, "stream", False)
    options = given.get("stream_options")
    if options is not None and not stream:
        raise InvalidRequest("stream_options is only allowed with stream=true", field="stream_options")
    include_usage = _stream_options(options)
    return Call(kind, model, request, n, stream, include_usage, logprobs, constraint_param=output.param, tools=use)


def _chat_inputs(given: Mapping[str, Any], use: ToolUse | None) -> list[Input]:
    messages = given.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array of chat messages", field="messages")
    turns = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object with role and content", field=where)
        for name, value in message.items():
            if name not in ("role", "content", *tools.MESSAGE_KEYS) and value not in (None, [], {}, ""):
                raise UnsupportedParameter(f"{where}.{name} is not supported (text chat messages only)", field=where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"{where}.role must be a non-empty string", field=where)
        role = "system" if role == "developer" else role  # OpenAI's newer name for the system turn
        turns.append(tools.chat_message(role, _content(message.get("content"), where), message, where))
    return [Input(messages=tuple(turns), tools=() if use is None else use.tools)]


def _content(content: object, where: str) -> str:
    """A message's text: a string, or an array of ``{"type": "text", "text": ...}`` parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise UnsupportedParameter(
                    f"{where}.content[{j}] is a {kind!r} part; only text parts are supported", field=where
                )
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequest(f"{where}.content must be a string or an array of text parts", field=where)


def _text_inputs(given: Mapping[str, Any]) -> list[Input]:
    prompt = given.get("prompt")
    if isinstance(prompt, str):
        return [Input(text=prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [Input(text=p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
        raise UnsupportedParameter("prompts given as token ids are not supported: send text", field="prompt")
    raise InvalidRequest("prompt must be a string or a non-empty array of strings", field="prompt")


def _sampling(given: Mapping[str, Any]) -> Sampling:
    # OpenAI's default temperature is 1 (sampling); 0 is greedy, as in the gRPC API.
    return Sampling(
        temperature=_number(given, "temperature", 1.0),
        top_p=_number(given, "top_p", 1.0),
        top_k=_integer(given, "top_k", 0, lowest=0),
        repetition_penalty=_number(given, "repetition_penalty", 1.0),
        seed=_integer(given, "seed", None, lowest=0, highest=2**64 - 1),
    )


def _adapters(given: Mapping[str, Any]) -> tuple[float | None, tuple[tuple[str, float], ...]]:
    """``adapter_scale`` (None: unset) and ``adapters``, a mixture: ``[{"id": ..., "weight": ...}, ...]`` (``[]``:
    none). Numbers are rounded to float32, as gRPC's are; ``model`` then names the base model or ``adapters[0]``
    (the frontend's ``checks.adapter_mix`` checks the rest)."""
    scale = None if "adapter_scale" not in given else _float32(_number(given, "adapter_scale", 1.0))
    items = given.get("adapters", [])
    if not isinstance(items, list):
        raise InvalidRequest('adapters must be an array of {"id": ..., "weight": ...} objects', field="adapters")
    mixture = []
    for i, item in enumerate(items):
        where = f"adapters[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f'{where} must be an object {{"id": ..., "weight": ...}}', field=where)
        for name in item:
            if name not in ("id", "weight"):
                raise UnknownParameter(f"unknown parameter {where}.{name!r}", field=f"{where}.{name}")
        adapter_id = item.get("id")
        if not isinstance(adapter_id, str):
            raise InvalidRequest(f"{where}.id must be an adapter id (a string)", field=f"{where}.id")
        if "weight" not in item:
            raise InvalidRequest(f"{where}.weight is missing: give each adapter a weight", field=f"{where}.weight")
        mixture.append((adapter_id, _float32(_number(item, "weight", 1.0, field=f"{where}.weight"))))
    return scale, tuple(mixture)


def _float32(x: float) -> float:
    return float(ctypes.c_float(x).value)


def _stopping(given: Mapping[str, Any]) -> tuple[int | None, tuple[str, ...], bool]:
    """``max_new_tokens`` (None = the server's default), the stop sequences and ``ignore_eos``."""
    tokens = _integer(given, "max_tokens", None, lowest=0)
    completion = _integer(given, "max_completion_tokens", None, lowest=0)
    if tokens is not None and completion is not None and tokens != completion:
        raise InvalidRequest(
            "max_tokens and max_completion_tokens differ: give one of them", field="max_completion_tokens"
        )
    limit = completion if completion is not None else tokens
    stop = given.get("stop")
    if isinstance(stop, str):
        stops: tuple[str, ...] = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        raise InvalidRequest("stop must be a string or an array of strings", field="stop")
    else:
        stops = ()
    return limit, stops, _boolean(given, "ignore_eos", False)


def _logprobs(kind: Kind, given: Mapping[str, Any]) -> bool:
    """Whether to return each chosen token's log-probability (top alternatives are not supported)."""
    if kind == "chat":
        top = _integer(given, "top_logprobs", 0, lowest=0)
        if top:
            raise UnsupportedParameter(
                "top_logprobs > 0 is not supported: the engine returns the log-probability of each chosen token "
                "only (logprobs=true, top_logprobs=0)",
                field="top_logprobs",
            )
        return _boolean(given, "logprobs", False)
    if "logprobs" not in given:
        return False
    if _integer(given, "logprobs", 0, lowest=0):
        raise UnsupportedParameter(
            "logprobs > 0 (top alternatives) is not supported: logprobs=0 returns the log-probability of each "
            "chosen token",
            field="logprobs",
        )
    return True


def _stream_options(options: object) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", field="stream_options")
    for name in options:
        if name != "include_usage":
            raise UnsupportedParameter(
                f"stream_options.{name} is not supported (only include_usage)", field="stream_options"
            )
    return _boolean(options, "include_usage", False)


def _string(given: Mapping[str, Any], name: str, *, required: bool = False) -> str:
    value = given.get(name)
    if isinstance(value, str) and value:
        return value
    if value is None and not required:
        return ""
    raise InvalidRequest(f"{name} must be a non-empty string", field=name)


def _boolean(given: Mapping[str, Any], name: str, default: bool) -> bool:
    value = given.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {type(value).__name__}", field=name)
    return value


def _number(given: Mapping[str, Any], name: str, default: float, *, field: str | None = None) -> float:
    value = given.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"{field or name} must be a finite number", field=field or name)
    return float(value)


def _integer(given: Mapping[str, Any], name: str, default: Any, *, lowest: int, highest: int = 2**32 - 1) -> Any:
    value = given.get(name, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= highest:
        raise InvalidRequest(f"{name} must be an integer in [{lowest}, {highest}], got {value!r}", field=name)
    return value


_COMMON = structured.NAMES | frozenset(
    {
        "model", "n", "stream", "stream_options", "temperature", "top_p", "seed", "stop", "max_tokens", "user",
        "logprobs",
        # extensions, named as vLLM names them
        "top_k", "repetition_penalty", "ignore_eos",
        # loraplex's own: an adapter's strength, a weighted mixture (docs/adapters.md)
        "adapter_scale", "adapters",
    }
)  # fmt: skip
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", *tools.PARAMS}
_COMPLETIONS = _COMMON | {"prompt"}
