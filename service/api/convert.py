"""The gRPC translator: protobuf messages <-> the frontend's domain types. Protobuf stops here.

``call_of`` turns a ``GenerateRequest`` / ``GenerateStreamRequest`` into a ``GenerationCall`` (assembly only: the
frontend checks it), ``input_of`` an ``Input``; ``result_of`` / ``stream_response`` / ``tokenize_response`` turn
the frontend's results back into reply messages (``adapter_scale`` and ``adapters`` travel as given: the
frontend's ``checks.adapter_mix`` checks them), shaped by the request's ``ReturnOptions``. ``grpc_fields``
renames the domain field of an ``InvalidRequest`` (``service.frontend.request``) to its path in the request
message (``max_new_tokens`` -> ``stopping.max_new_tokens``; ``inputs[0].text`` -> ``input.text`` in a
GenerateStream), so clients keep reading protobuf paths in ``ErrorInfo.metadata["field"]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from loraplex.v1 import generation_pb2 as pb

from service.constraints.spec import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint
from service.errors import InvalidRequest
from service.frontend import (
    ChatMessage,
    Completion,
    FinishReason,
    GenerationCall,
    Input,
    Sampling,
    TokenEvent,
    Tokenized,
)

FINISH_TO_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.DEADLINE: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_CANCELLED,
    FinishReason.DEAD_END: pb.FINISH_REASON_DEAD_END,
}

DIALECTS = {pb.GRAMMAR_DIALECT_LARK: "lark", pb.GRAMMAR_DIALECT_GBNF: "gbnf"}
"""``GrammarDialect`` -> the domain's dialect name (UNSPECIFIED, or a value this server does not know, is refused)."""

_FIELDS = (("max_new_tokens", "stopping.max_new_tokens"), ("stop_sequences", "stopping.stop_sequences"))
"""Domain field prefix -> its path in a generation request message (the rest are the same in both)."""


def field_of(field: str, *, stream: bool) -> str:
    """The request message's path of a domain ``field`` (``stop_sequences[1]`` -> ``stopping.stop_sequences[1]``)."""
    for prefix, path in _FIELDS:
        if field.startswith(prefix):
            return path + field.removeprefix(prefix)
    if stream and field.startswith("inputs[0]"):
        return "input" + field.removeprefix("inputs[0]")
    return field


@contextlib.contextmanager
def grpc_fields(*, stream: bool) -> Iterator[None]:
    """Inside: an ``InvalidRequest`` leaves with its ``field`` as a path in the (stream) request message."""
    try:
        yield
    except InvalidRequest as exc:
        if exc.field is None:
            raise
        raise exc.at(field_of(exc.field, stream=stream)) from None


def input_of(message: pb.Input) -> Input:
    kind = message.WhichOneof("kind")
    if kind == "messages":
        turns = tuple(ChatMessage(m.role, m.content) for m in message.messages.messages)
        return Input(messages=turns, chat=message.chat)
    return Input(text=message.text if kind == "text" else None, chat=message.chat)


def _sampling_of(message: pb.SamplingParams) -> Sampling:
    return Sampling(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p if message.HasField("top_p") else 1.0,
        repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty") else 1.0,
        seed=message.seed if message.HasField("seed") else None,
    )


def constraint_of(message: pb.GenerateRequest | pb.GenerateStreamRequest) -> Constraint | None:
    """The domain constraint of a request (None: unset, or no kind set). Raises ``InvalidRequest`` for a grammar
    without a known dialect; everything else is checked by the frontend (``check_constraint``)."""
    if not message.HasField("constraint"):
        return None
    c = message.constraint
    kind = c.WhichOneof("kind")
    if kind == "json_schema":
        return Constraint(JSON_SCHEMA, source=c.json_schema)
    if kind == "json_object":
        return Constraint(JSON_OBJECT)
    if kind == "regex":
        return Constraint(REGEX, source=c.regex)
    if kind == "grammar":
        dialect = DIALECTS.get(c.grammar.dialect)
        if dialect is None:
            raise InvalidRequest(
                f"constraint.grammar.dialect must be GRAMMAR_DIALECT_LARK or GRAMMAR_DIALECT_GBNF, got "
                f"{_enum_name(pb.GrammarDialect, c.grammar.dialect)}",
                field="constraint.grammar.dialect",
            )
        return Constraint(GRAMMAR, source=c.grammar.text, dialect=dialect)
    if kind == "choice":
        return Constraint(CHOICE, choices=tuple(c.choice.choices))
    return None


def _enum_name(enum: Any, value: int) -> str:
    try:
        return str(enum.Name(value))
    except ValueError:
        return str(value)


def call_of(message: pb.GenerateRequest | pb.GenerateStreamRequest, *, deadline: float | None) -> GenerationCall:
    """The domain call of a generation request (``deadline``: a ``time.monotonic()`` instant, or None)."""
    stopping = message.stopping
    if isinstance(message, pb.GenerateRequest):
        inputs = tuple(input_of(item) for item in message.inputs)
    else:
        inputs = (input_of(message.input),)
    return GenerationCall(
        inputs=inputs,
        adapter_id=message.adapter_id,
        sampling=_sampling_of(message.sampling),
        max_new_tokens=stopping.max_new_tokens if stopping.HasField("max_new_tokens") else None,
        stop_sequences=tuple(stopping.stop_sequences),
        ignore_eos=stopping.ignore_eos,
        speculate=message.speculate if message.HasField("speculate") else None,
        logprobs=message.return_options.return_logprobs,
        request_id=message.request_id,
        deadline=deadline,
        constraint=constraint_of(message),
        adapter_scale=message.adapter_scale if message.HasField("adapter_scale") else None,
        adapters=tuple((a.id, a.weight) for a in message.adapters),
    )


def _usage(prompt: int, generated: int, accepted: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt, generated_tokens=generated, accepted_draft_tokens=accepted)


def result_of(completion: Completion, options: pb.ReturnOptions) -> pb.GenerationResult:
    c = completion
    result = pb.GenerationResult(text=c.text, finish_reason=FINISH_TO_PB[c.finish], stop_sequence=c.stop_sequence)
    if options.return_token_ids:
        result.token_ids.extend(c.token_ids)
    if options.return_logprobs:
        result.logprobs.extend(c.logprobs)
    result.usage.CopyFrom(_usage(c.prompt_tokens, c.generated_tokens, c.accepted_draft_tokens))
    return result


def stream_response(event: TokenEvent, options: pb.ReturnOptions) -> pb.GenerateStreamResponse:
    response = pb.GenerateStreamResponse(text=event.text)
    if options.return_token_ids:
        response.token_ids.extend(event.token_ids)
    if options.return_logprobs and event.logprobs is not None:
        response.logprobs.extend(event.logprobs)
    if event.finish is not None:
        response.finish_reason = FINISH_TO_PB[event.finish]
        response.usage.CopyFrom(_usage(event.prompt_tokens, event.generated_tokens, event.accepted_draft_tokens))
        response.stop_sequence = event.stop_sequence
    return response


def tokenize_response(tokenized: Tokenized) -> pb.TokenizeResponse:
    return pb.TokenizeResponse(
        token_ids=tokenized.token_ids, tokens=tokenized.tokens, rendered_text=tokenized.rendered_text
    )
