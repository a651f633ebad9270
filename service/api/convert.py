"""Protobuf <-> domain conversion. Protobuf stops here: nothing below the servicer imports generated code.

Validation happens once, here, where protobuf becomes domain types: ``precheck`` runs every cheap check of a
request (sizes from ``service.api.limits``, the request id, max_new_tokens) and builds its ``SamplingParams``
(valid by construction) on the event loop, returning a ``Checked``; ``generation_request`` only assembles a
``GenerationRequest`` from it and a tokenized prompt. ``prompt_of`` and ``tokenize_response`` tokenize and
template, so the servicer runs them on the runtime's worker pool, never on the event loop. The engine's own
``validate`` (prompt length, vocabulary, adapter) is the one check left after tokenization.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from loraplex.v1 import generation_pb2 as pb

from service.api import limits
from service.config import Settings
from service.engine.request import FinishReason, GenerationRequest, TokenEvent, check_max_new_tokens
from service.engine.sampling import SamplingParams
from service.errors import InvalidRequest
from service.logs import REQUEST_ID
from service.tokenizer import Tokenizer

_REQUEST_ID = re.compile(rf"^[\x21-\x7e]{{1,{limits.REQUEST_ID_MAX_CHARS}}}$")

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
            raise InvalidRequest("input.messages is empty: give at least one chat message", field="input.messages")
        if any(not t["role"] for t in turns):
            raise InvalidRequest("every chat message needs a role (e.g. 'user')", field="input.messages.role")
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True)
        return Prompt(tuple(tokenizer.encode(text, add_special_tokens=False)), text)
    if kind == "text":
        if not message.text:
            raise InvalidRequest("the prompt is empty: set input.text to some text", field="input.text")
        if message.chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": message.text}], add_generation_prompt=True
            )
            return Prompt(tuple(tokenizer.encode(text, add_special_tokens=False)), text)
        return Prompt(tuple(tokenizer.encode(message.text)), message.text)
    raise InvalidRequest("input needs either `text` or `messages`", field="input")


def tokenize_response(message: pb.Input, tokenizer: Tokenizer) -> pb.TokenizeResponse:
    prompt = prompt_of(message, tokenizer)
    return pb.TokenizeResponse(
        token_ids=prompt.ids,
        tokens=[tokenizer.id_to_token(i) or "" for i in prompt.ids],
        rendered_text=prompt.rendered,
    )


@dataclass(frozen=True)
class Checked:
    """A generation request's fields, every one checked, before its prompts are tokenized. ``sampling`` has one
    entry per input (input i is seeded with seed + i)."""

    request_id: str
    max_new_tokens: int
    sampling: tuple[SamplingParams, ...]


def precheck(message: pb.GenerateRequest | pb.GenerateStreamRequest, settings: Settings) -> Checked:
    """Everything about a generation request that can be refused before its prompts are tokenized."""
    limits.check_generate(message, settings)
    request_id = request_id_of(message.request_id)
    max_new = _max_new_tokens(message.stopping, settings.max_new_tokens)
    check_max_new_tokens(max_new, settings.max_new_tokens)
    inputs = len(message.inputs) if isinstance(message, pb.GenerateRequest) else 1
    logprobs = message.return_options.return_logprobs
    sampling = tuple(sampling_of(message.sampling, logprobs=logprobs, seed_offset=i) for i in range(inputs))
    return Checked(request_id, max_new, sampling)


def _max_new_tokens(stopping: pb.StoppingCriteria, default: int) -> int:
    return stopping.max_new_tokens if stopping.HasField("max_new_tokens") else default


def sampling_of(message: pb.SamplingParams, *, logprobs: bool, seed_offset: int = 0) -> SamplingParams:
    # Input i of a request is seeded with seed + i, wrapping modulo 2**64 (so every uint64 seed stays valid).
    seed = (message.seed + seed_offset) % 2**64 if message.HasField("seed") else None
    return SamplingParams(  # raises InvalidRequest naming the field: valid by construction
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p if message.HasField("top_p") else 1.0,
        repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty") else 1.0,
        seed=seed,
        logprobs=logprobs,
    )


def is_request_id(text: str) -> bool:
    """Whether ``text`` is a valid request id: 1-128 printable ASCII characters without spaces."""
    return bool(_REQUEST_ID.match(text))


def request_id_of(given: str) -> str:
    if not given:
        return uuid.uuid4().hex[:16]
    if not _REQUEST_ID.match(given):
        raise InvalidRequest(
            "request_id must be 1-128 printable ASCII characters without spaces",
            field="request_id",
            limit=limits.REQUEST_ID_MAX_CHARS,
        )
    return given


def generation_request(
    message: pb.GenerateRequest | pb.GenerateStreamRequest,
    checked: Checked,
    prompt: Prompt,
    *,
    deadline: float | None,
    index: int = 0,
) -> GenerationRequest:
    """Input ``index`` of ``message`` as a domain request (its id is ``<request id>/<index>`` when there are
    several; its ``call_id`` the id of the call running it, which its engine log lines carry): assembly only, every
    field was checked by ``precheck``."""
    stopping = message.stopping
    several = len(checked.sampling) > 1
    return GenerationRequest(
        request_id=f"{checked.request_id}/{index}" if several else checked.request_id,
        prompt_ids=prompt.ids,
        max_new_tokens=checked.max_new_tokens,
        sampling=checked.sampling[index],
        adapter_id=message.adapter_id or None,
        stop_sequences=tuple(stopping.stop_sequences),
        ignore_eos=stopping.ignore_eos,
        speculate=message.speculate if message.HasField("speculate") else None,
        deadline=deadline,
        call_id=REQUEST_ID.get() or "",
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
