"""Protobuf <-> domain conversion. Protobuf stops here: nothing below the servicer imports generated code."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from loraplex.v1 import generation_pb2 as pb

from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.engine.sampling import SamplingParams
from service.errors import InvalidRequest
from service.tokenizer import Tokenizer

_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")

FINISH_TO_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.DEADLINE: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_CANCELLED,
}


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    rendered: str


def prompt_of(message: pb.Input, tokenizer: Tokenizer) -> Prompt:
    """Token ids of one input, with the chat template applied when the input asks for it."""
    kind = message.WhichOneof("kind")
    if kind == "messages":
        turns = [{"role": m.role, "content": m.content} for m in message.messages.messages]
        if not turns:
            raise InvalidRequest("input.messages is empty: give at least one chat message")
        if any(not t["role"] for t in turns):
            raise InvalidRequest("every chat message needs a role (e.g. 'user')")
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True)
        return Prompt(tuple(tokenizer.encode(text, add_special_tokens=False)), text)
    if kind == "text":
        if not message.text:
            raise InvalidRequest("the prompt is empty: set input.text to some text")
        if message.chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": message.text}], add_generation_prompt=True
            )
            return Prompt(tuple(tokenizer.encode(text, add_special_tokens=False)), text)
        return Prompt(tuple(tokenizer.encode(message.text)), message.text)
    raise InvalidRequest("input needs either `text` or `messages`")


def sampling_of(message: pb.SamplingParams, *, logprobs: bool, seed_offset: int = 0) -> SamplingParams:
    # Input i of a request is seeded with seed + i, wrapping modulo 2**64 (so every uint64 seed stays valid).
    seed = (message.seed + seed_offset) % 2**64 if message.HasField("seed") else None
    params = SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p if message.HasField("top_p") else 1.0,
        repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty") else 1.0,
        seed=seed,
        logprobs=logprobs,
    )
    params.validate()
    return params


def request_id_of(given: str) -> str:
    if not given:
        return uuid.uuid4().hex[:16]
    if not _REQUEST_ID.match(given):
        raise InvalidRequest("request_id must be 1-128 printable ASCII characters without spaces")
    return given


def generation_request(
    message: pb.GenerateRequest | pb.GenerateStreamRequest,
    prompt: Prompt,
    *,
    request_id: str,
    default_max_new_tokens: int,
    deadline: float | None,
    seed_offset: int = 0,
) -> GenerationRequest:
    stopping = message.stopping
    max_new = stopping.max_new_tokens if stopping.HasField("max_new_tokens") else default_max_new_tokens
    if any(not s for s in stopping.stop_sequences):
        raise InvalidRequest("stop_sequences must not contain empty strings")
    return GenerationRequest(
        request_id=request_id,
        prompt_ids=prompt.ids,
        max_new_tokens=max_new,
        sampling=sampling_of(
            message.sampling, logprobs=message.return_options.return_logprobs, seed_offset=seed_offset
        ),
        adapter_id=message.adapter_id or None,
        stop_sequences=tuple(stopping.stop_sequences),
        ignore_eos=stopping.ignore_eos,
        speculate=message.speculate if message.HasField("speculate") else None,
        deadline=deadline,
    )


def usage_of(event: TokenEvent) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=event.prompt_tokens,
        generated_tokens=event.generated_tokens,
        accepted_draft_tokens=event.accepted_draft_tokens,
    )


def stream_response(event: TokenEvent, options: pb.ReturnOptions) -> pb.GenerateStreamResponse:
    response = pb.GenerateStreamResponse(text=event.text)
    if options.return_token_ids:
        response.token_ids.extend(event.token_ids)
    if options.return_logprobs and event.logprobs is not None:
        response.logprobs.extend(event.logprobs)
    if event.finish is not None:
        response.finish_reason = FINISH_TO_PB[event.finish]
        response.usage.CopyFrom(usage_of(event))
        response.stop_sequence = event.stop_sequence
    return response
