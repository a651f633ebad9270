"""Between Python arguments / results and the ``loraplex.v1`` messages.

Request builders check what the client can see is wrong (types, ranges, empty lists) and raise
``TypeError`` / ``ValueError`` before any RPC; everything that depends on the model or the server's
limits is left to the server. Response converters turn messages into the frozen dataclasses of
``loraplex._types``. The sync and async clients share all of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypedDict

from google.protobuf import timestamp_pb2

from loraplex._constraint import constraint_message
from loraplex._mixture import mixture_fields
from loraplex._types import (
    AdapterInfo,
    AdapterKind,
    AdapterState,
    ChatMessage,
    ComputePath,
    Conversation,
    Delta,
    FinishReason,
    Generation,
    Limits,
    LoadLatency,
    ModelInfo,
    SamplingParams,
    TokenizeResult,
    Usage,
    WeightedAdapter,
)
from loraplex.v1 import adapters_pb2, generation_pb2

Prompt = str | Conversation
"""One prompt: text, or a conversation (list of chat turns)."""

_UINT32 = 1 << 32
_UINT64 = 1 << 64
MAX_ID_CHARS = 128

_FINISH_REASONS = {
    generation_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    generation_pb2.FINISH_REASON_EOS: FinishReason.EOS,
    generation_pb2.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE,
    generation_pb2.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
    generation_pb2.FINISH_REASON_DEAD_END: FinishReason.DEAD_END,
}
_ADAPTER_KINDS = {
    adapters_pb2.ADAPTER_KIND_LORA: AdapterKind.LORA,
    adapters_pb2.ADAPTER_KIND_MEDUSA: AdapterKind.MEDUSA,
    adapters_pb2.ADAPTER_KIND_MEDUSA_LORA: AdapterKind.MEDUSA_LORA,
}
_ADAPTER_STATES = {
    adapters_pb2.ADAPTER_STATE_REGISTERED: AdapterState.REGISTERED,
    adapters_pb2.ADAPTER_STATE_HOST: AdapterState.HOST,
    adapters_pb2.ADAPTER_STATE_DEVICE: AdapterState.DEVICE,
    adapters_pb2.ADAPTER_STATE_LOADING: AdapterState.LOADING,
    adapters_pb2.ADAPTER_STATE_FAILED: AdapterState.FAILED,
    adapters_pb2.ADAPTER_STATE_UNLOADED: AdapterState.UNLOADED,
}


class GenerateOptions(TypedDict, total=False):
    """Keyword arguments of ``generate`` and ``stream`` (all optional).

    adapter             registered adapter id; None / "" = the base model. Also sent as the
                        ``x-loraplex-adapter`` request header for adapter-aware routing.
    sampling            a ``SamplingParams``; the five keywords below override its fields.
    temperature         >= 0; 0 (default) = greedy (the server treats below 1e-5 as greedy).
    top_k               0 (default) = off.
    top_p               in (0, 1]; None (default) = off.
    repetition_penalty  > 0 (the server accepts [0.01, 100]); None (default) = off.
    seed                0 <= seed < 2**64; None = random. Prompt i of a batch is seeded with
                        (seed + i) mod 2**64.
    max_new_tokens      >= 1; None = the server's limit (``ModelInfo.limits.max_new_tokens``).
    stop                a stop sequence or a list of them; the text ends before the match.
    ignore_eos          keep generating past end-of-sequence (benchmarks). Default False.
    chat                apply the model's chat template to text prompts. Default False.
                        Conversations (lists of messages) always get the template.
    adapter_scale       the adapter's strength: its deltas times this (PEFT's scaling change); None = 1.
    adapters            a mixture: WeightedAdapter or (id, weight) pairs, the weighted sum of their
                        deltas (PEFT's add_weighted_adapter "cat"); ``adapter`` then is None or the
                        first id. Not with adapter_scale. Metrics and the routing header name the first.
    speculate           Medusa speculative decoding; None (default) = on when the adapter has heads.
    return_token_ids    fill ``token_ids``. Default False.
    return_logprobs     fill ``logprobs``. Default False.
    request_id          an id for server logs; "" = the server makes one.

    Output constraints (structured output), at most one of them; every output must match it:
    json_schema         a JSON Schema, as a dict or a str of JSON: the output is one JSON value valid
                        against it.
    json_object         True: the output is a JSON object (any). Default False.
    regex               a regular expression (Rust ``regex`` syntax) the whole output matches.
    grammar             a context-free grammar's text, in ``grammar_dialect``.
    grammar_dialect     "lark" (default; llguidance's Lark, start rule ``start``) or "gbnf"
                        (llama.cpp's GBNF, start rule ``root``).
    choice              a list of strings: the output is exactly one of them.
    """

    adapter: str | None
    adapter_scale: float | None
    adapters: Sequence[WeightedAdapter | tuple[str, float]] | None
    sampling: SamplingParams | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    repetition_penalty: float | None
    seed: int | None
    max_new_tokens: int | None
    stop: str | Sequence[str] | None
    ignore_eos: bool
    chat: bool
    speculate: bool | None
    return_token_ids: bool
    return_logprobs: bool
    request_id: str | None
    json_schema: Mapping[str, Any] | str | None
    json_object: bool
    regex: str | None
    grammar: str | None
    grammar_dialect: str | None
    choice: Sequence[str] | None


@dataclass(frozen=True)
class GenerationOptions:
    """Everything of a generation call but its prompts, checked. Built by ``generation_options``."""

    adapter_id: str
    chat: bool
    sampling: generation_pb2.SamplingParams
    stopping: generation_pb2.StoppingCriteria
    return_options: generation_pb2.ReturnOptions
    speculate: bool | None
    request_id: str
    constraint: generation_pb2.Constraint | None = None
    mixture: Mapping[str, Any] | None = None  # adapter_scale / adapters fields, when given


# --------------------------------------------------------------------------------------- validation


def _int(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an int in [low, high); bools are not ints here."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {value}")
    return value


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {value}")
    return result


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_id(name: str, value: object, *, allow_empty: bool) -> str:
    """An adapter or request id: printable ASCII, no spaces (it travels in metadata), at most 128 chars."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not value and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"{name} is {len(value)} chars; at most {MAX_ID_CHARS}")
    bad = [c for c in value if not " " < c <= "~"]
    if bad:
        raise ValueError(f"{name} {value!r} may hold only printable ASCII without spaces, not {bad[:3]!r}")
    return value


def _stop_sequences(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"stop sequences must be str, got {type(item).__name__}")
        if not item:
            raise ValueError("stop sequences must not be empty strings")
    return items


def sampling_params(
    base: SamplingParams | None,
    *,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    repetition_penalty: float | None,
    seed: int | None,
) -> generation_pb2.SamplingParams:
    """``base`` (default: greedy) with the keyword arguments that were given laid over it, checked."""
    if base is not None and not isinstance(base, SamplingParams):
        raise TypeError(f"sampling must be a loraplex.SamplingParams, got {type(base).__name__}")
    base = base or SamplingParams()
    temperature = base.temperature if temperature is None else temperature
    top_k = base.top_k if top_k is None else top_k
    top_p = base.top_p if top_p is None else top_p
    repetition_penalty = base.repetition_penalty if repetition_penalty is None else repetition_penalty
    seed = base.seed if seed is None else seed

    message = generation_pb2.SamplingParams(
        temperature=_float("temperature", temperature), top_k=_int("top_k", top_k, 0, _UINT32)
    )
    if message.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_p is not None:
        message.top_p = _float("top_p", top_p)
        if not 0.0 < message.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if repetition_penalty is not None:
        message.repetition_penalty = _float("repetition_penalty", repetition_penalty)
        if message.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {repetition_penalty}")
    if seed is not None:
        message.seed = _int("seed", seed, 0, _UINT64)
    return message


def generation_options(
    *,
    adapter: str | None = None,
    adapter_scale: float | None = None,
    adapters: Sequence[WeightedAdapter | tuple[str, float]] | None = None,
    sampling: SamplingParams | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    max_new_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    chat: bool = False,
    speculate: bool | None = None,
    return_token_ids: bool = False,
    return_logprobs: bool = False,
    request_id: str | None = None,
    json_schema: Mapping[str, Any] | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    grammar_dialect: str | None = None,
    choice: Sequence[str] | None = None,
) -> GenerationOptions:
    """Check the keyword arguments shared by ``generate`` and ``stream`` (see ``GenerateOptions``).

    An unknown keyword raises ``TypeError``, as for any Python function."""
    stopping = generation_pb2.StoppingCriteria(
        stop_sequences=_stop_sequences(stop), ignore_eos=_bool("ignore_eos", ignore_eos)
    )
    if max_new_tokens is not None:
        stopping.max_new_tokens = _int("max_new_tokens", max_new_tokens, 1, _UINT32)
    adapter_id, mixture = mixture_fields(check_id("adapter", adapter or "", allow_empty=True), adapter_scale, adapters)
    return GenerationOptions(
        adapter_id=check_id("adapter", adapter_id, allow_empty=True),
        mixture=mixture or None,
        chat=_bool("chat", chat),
        sampling=sampling_params(
            sampling,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
        ),
        stopping=stopping,
        return_options=generation_pb2.ReturnOptions(
            return_token_ids=_bool("return_token_ids", return_token_ids),
            return_logprobs=_bool("return_logprobs", return_logprobs),
        ),
        speculate=None if speculate is None else _bool("speculate", speculate),
        request_id=check_id("request_id", request_id or "", allow_empty=True),
        constraint=constraint_message(
            json_schema=json_schema,
            json_object=json_object,
            regex=regex,
            grammar=grammar,
            grammar_dialect=grammar_dialect,
            choice=choice,
        ),
    )


# ------------------------------------------------------------------------------------------ prompts


def _is_message(item: object) -> bool:
    return isinstance(item, (ChatMessage, Mapping))


def _chat_message(item: object, index: int) -> generation_pb2.ChatMessage:
    if isinstance(item, ChatMessage):
        role, content = item.role, item.content
    elif isinstance(item, Mapping):
        missing = {"role", "content"} - set(item)
        if missing:
            raise ValueError(f"message {index} lacks {sorted(missing)}")
        role, content = item["role"], item["content"]
    else:
        raise TypeError(f"message {index} must be a ChatMessage or a mapping, got {type(item).__name__}")
    if not isinstance(role, str) or not isinstance(content, str):
        raise TypeError(f"message {index}: role and content must be str")
    if not role:
        raise ValueError(f"message {index}: role must not be empty")
    return generation_pb2.ChatMessage(role=role, content=content)


def build_input(prompt: object, *, chat: bool) -> generation_pb2.Input:
    """One prompt (text, or a conversation) as an ``Input`` message."""
    _bool("chat", chat)
    if isinstance(prompt, str):
        return generation_pb2.Input(text=prompt, chat=chat)
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be str, not bytes: decode it first")
    if not isinstance(prompt, Sequence):
        raise TypeError(f"prompt must be a str or a list of chat messages, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("a conversation needs at least one message")
    if not _is_message(prompt[0]):
        raise TypeError(
            "expected one prompt (a str, or a conversation: a list of chat messages), got a list of "
            f"{type(prompt[0]).__name__}; several prompts go to generate() as a batch"
        )
    messages = [_chat_message(item, i) for i, item in enumerate(prompt)]
    return generation_pb2.Input(messages=generation_pb2.ChatMessages(messages=messages))


def build_inputs(prompt: object, *, chat: bool) -> tuple[list[generation_pb2.Input], bool]:
    """``generate``'s first argument as inputs, and whether it was a single prompt.

    A str or a conversation (a list whose items are chat messages) is one prompt; any other list is a
    batch whose items are each a str or a conversation.
    """
    if isinstance(prompt, str):
        return [build_input(prompt, chat=chat)], True
    if _is_message(prompt):
        raise TypeError("a single chat message must be wrapped in a list (a conversation)")
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        if not prompt:
            raise ValueError("no prompts given")
        if _is_message(prompt[0]):
            return [build_input(prompt, chat=chat)], True
        return [build_input(item, chat=chat) for item in prompt], False
    return [build_input(prompt, chat=chat)], True  # raises the right TypeError


def _request_fields(options: GenerationOptions) -> dict[str, Any]:
    """The fields a GenerateRequest and a GenerateStreamRequest share."""
    fields: dict[str, Any] = {
        "adapter_id": options.adapter_id,
        "sampling": options.sampling,
        "stopping": options.stopping,
        "return_options": options.return_options,
        "request_id": options.request_id,
    }
    if options.speculate is not None:
        fields["speculate"] = options.speculate
    if options.constraint is not None:
        fields["constraint"] = options.constraint
    fields.update(options.mixture or {})
    return fields


def generate_request(inputs: list[generation_pb2.Input], options: GenerationOptions) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(inputs=inputs, **_request_fields(options))


def stream_request(
    prompt_input: generation_pb2.Input, options: GenerationOptions
) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(input=prompt_input, **_request_fields(options))


def load_adapter_request(adapter_id: object, source: object) -> adapters_pb2.LoadAdapterRequest:
    if not isinstance(source, str):
        # os.PathLike is accepted by the clients and turned into str before this point.
        raise TypeError(f"source must be a path or hf://org/name[@revision] (str), got {type(source).__name__}")
    if not source:
        raise ValueError("source must not be empty")
    return adapters_pb2.LoadAdapterRequest(id=check_id("adapter id", adapter_id, allow_empty=False), source=source)


# ---------------------------------------------------------------------------------------- responses


def _usage(message: generation_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=message.prompt_tokens,
        generated_tokens=message.generated_tokens,
        accepted_draft_tokens=message.accepted_draft_tokens,
    )


def generations_of(
    response: generation_pb2.GenerateResponse, prompts: int, *, single: bool
) -> Generation | list[Generation]:
    """The answer of ``generate``: one ``Generation`` per prompt, in order (``single``: just the one)."""
    results = [to_generation(r, response.request_id) for r in response.results]
    if len(results) != prompts:
        raise RuntimeError(f"server answered {len(results)} results for {prompts} prompts")
    return results[0] if single else results


def to_generation(result: generation_pb2.GenerationResult, request_id: str) -> Generation:
    return Generation(
        text=result.text,
        finish_reason=_FINISH_REASONS.get(result.finish_reason, FinishReason.UNSPECIFIED),
        usage=_usage(result.usage),
        token_ids=tuple(result.token_ids),
        logprobs=tuple(result.logprobs),
        stop_sequence=result.stop_sequence or None,
        request_id=request_id,
    )


def to_delta(message: generation_pb2.GenerateStreamResponse) -> Delta:
    last = message.HasField("usage") or message.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
    return Delta(
        text=message.text,
        token_ids=tuple(message.token_ids),
        logprobs=tuple(message.logprobs),
        finish_reason=_FINISH_REASONS.get(message.finish_reason, FinishReason.UNSPECIFIED) if last else None,
        usage=_usage(message.usage) if last else None,
        stop_sequence=message.stop_sequence or None,
        request_id=message.request_id,
    )


def to_tokenize_result(message: generation_pb2.TokenizeResponse) -> TokenizeResult:
    return TokenizeResult(
        token_ids=tuple(message.token_ids), tokens=tuple(message.tokens), rendered_text=message.rendered_text
    )


def to_model_info(message: generation_pb2.ModelInfoResponse) -> ModelInfo:
    limits = message.limits
    return ModelInfo(
        model_name=message.model_name,
        model_path=message.model_path,
        architecture=message.architecture,
        dtype=message.dtype,
        device=message.device,
        vocab_size=message.vocab_size,
        context_length=message.context_length,
        limits=Limits(
            max_batch_size=limits.max_batch_size,
            max_prompt_tokens=limits.max_prompt_tokens,
            max_new_tokens=limits.max_new_tokens,
            max_total_tokens=limits.max_total_tokens,
            max_queue=limits.max_queue,
            max_mixture_adapters=limits.max_mixture_adapters,
        ),
        features=tuple(message.features),
        server_version=message.server_version,
        load_mode=message.load_mode,
        load_seconds=message.load_seconds,
        eos_token_ids=tuple(message.eos_token_ids),
        cpu_capability=message.cpu_capability,
        weights=message.weights,
        compute_paths=tuple(
            ComputePath(path=c.path, kernel=c.kernel, error=c.error, tolerance=c.tolerance, status=c.status)
            for c in message.compute_paths
        ),
    )


def _utc(message: timestamp_pb2.Timestamp, present: bool) -> datetime | None:
    return message.ToDatetime(tzinfo=UTC) if present else None


def to_adapter_info(message: adapters_pb2.AdapterInfo) -> AdapterInfo:
    latency = message.load_latency
    return AdapterInfo(
        id=message.id,
        source=message.source,
        kind=_ADAPTER_KINDS.get(message.kind, AdapterKind.UNSPECIFIED),
        state=_ADAPTER_STATES.get(message.state, AdapterState.UNSPECIFIED),
        rank=message.rank,
        alpha=message.alpha,
        target_modules=tuple(message.target_modules),
        medusa_heads=message.medusa_heads,
        total_bytes=message.total_bytes,
        host_bytes=message.host_bytes,
        device_bytes=message.device_bytes,
        num_layers=message.num_layers,
        host_layers=message.host_layers,
        device_layers=message.device_layers,
        hits=message.hits,
        last_used=_utc(message.last_used, message.HasField("last_used")),
        registered_at=_utc(message.registered_at, message.HasField("registered_at")),
        load_latency=LoadLatency(
            index_seconds=latency.index_seconds,
            read_seconds=latency.read_seconds,
            layout_seconds=latency.layout_seconds,
            total_seconds=latency.total_seconds,
        ),
        active_requests=message.active_requests,
        pinned=message.pinned,
        error=message.error or None,
        loads=message.loads,
        disk_reads=message.disk_reads,
        resolved_path=message.resolved_path,
    )
