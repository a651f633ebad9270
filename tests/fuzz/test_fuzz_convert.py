"""Fuzzing request conversion (``service.api.convert`` + ``service.frontend.checks``): protobuf -> domain request.

Random valid-looking ``GenerateRequest`` / ``GenerateStreamRequest`` messages (every field set or unset, edge
values for numbers, any Unicode in strings, chat and raw inputs) and the same messages damaged on the wire
(bytes flipped, cut or spliced, then parsed the way grpc parses them) go through what the servicer runs before
it submits: ``call_of``, ``check``, ``prompt_of`` with SmolLM2's tokenizer and chat template, ``engine_request``
(an output constraint of any kind, or of an unknown grammar dialect, is converted and size-checked, not compiled).
Each ends in a ``GenerationRequest`` whose fields are in range, or a ``LoraplexError``, never another exception.
Bytes that do not parse are the transport edge's business (``DecodeError``) and are skipped here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.message import DecodeError
from hypothesis import event, given
from hypothesis import strategies as st
from loraplex.v1 import generation_pb2 as pb
from support.fuzz import fuzz_settings, typed_outcome

from service.api import convert
from service.config import Settings
from service.engine.request import GenerationRequest
from service.errors import InvalidRequest, LoraplexError
from service.frontend import checks
from service.frontend.prompts import prompt_of
from service.tokenizer import Tokenizer

TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
SHORT = st.text(st.characters(codec="utf-8"), max_size=8)
F32 = st.floats(width=32)
U32 = st.one_of(st.integers(0, 8), st.sampled_from([2**31, 2**32 - 1]))
U64 = st.one_of(st.integers(0, 8), st.sampled_from([2**63, 2**64 - 2, 2**64 - 1]), st.integers(0, 2**64 - 1))


def _mostly(plausible: st.SearchStrategy[object], anything: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    """Three times in four a value a client would send, else any value of the field's type."""
    return st.integers(0, 3).flatmap(lambda i: anything if i == 3 else plausible)


TEMPERATURE = _mostly(st.sampled_from([0.0, 0.5, 1.0, 1e-45, 1e-38, 100.0]), F32)
PROBABILITY = _mostly(st.sampled_from([0.1, 0.9, 1.0, 1e-45]), F32)
PENALTY = _mostly(st.sampled_from([1.0, 1.2, 0.5, 1e-45, 1e30]), F32)
ROLES = _mostly(st.sampled_from(["user", "assistant", "system"]), st.one_of(st.just(""), SHORT))
PROMPT = _mostly(TEXT.filter(bool), st.just(""))
REQUEST_ID = _mostly(st.sampled_from(["", "req-1", "a" * 128]), st.one_of(SHORT, st.just("x" * 129)))


@st.composite
def inputs(draw: st.DrawFn) -> pb.Input:
    kind = draw(_mostly(st.sampled_from(["text", "messages"]), st.just("none")))
    message = pb.Input(chat=draw(st.booleans()))
    if kind == "text":
        message.text = draw(PROMPT)
    elif kind == "messages":
        turns = draw(st.lists(st.tuples(ROLES, TEXT), min_size=draw(_mostly(st.just(1), st.just(0))), max_size=3))
        message.messages.SetInParent()  # an empty conversation is still "messages"
        for role, content in turns:
            message.messages.messages.add(role=role, content=content)
    return message


@st.composite
def sampling(draw: st.DrawFn) -> pb.SamplingParams:
    message = pb.SamplingParams(temperature=draw(TEMPERATURE), top_k=draw(U32))
    if draw(st.booleans()):
        message.top_p = draw(PROBABILITY)
    if draw(st.booleans()):
        message.repetition_penalty = draw(PENALTY)
    if draw(st.booleans()):
        message.seed = draw(U64)
    return message


DIALECTS = _mostly(
    st.sampled_from([pb.GRAMMAR_DIALECT_LARK, pb.GRAMMAR_DIALECT_GBNF]), st.integers(-(2**31), 2**31 - 1)
)


@st.composite
def constraints(draw: st.DrawFn) -> pb.Constraint:
    """Any kind of the oneof (or none), with any text: conversion and the size checks, never compiled here."""
    kind = draw(st.sampled_from(["json_schema", "json_object", "regex", "grammar", "choice", "none"]))
    message = pb.Constraint()
    if kind in ("json_schema", "regex"):
        setattr(message, kind, draw(st.one_of(TEXT, st.just('{"type": "object"}'))))
    elif kind == "json_object":
        message.json_object.SetInParent()
    elif kind == "grammar":
        message.grammar.text = draw(TEXT)
        message.grammar.dialect = draw(DIALECTS)  # type: ignore[assignment]  # proto3 enums are open: any int32
    elif kind == "choice":
        message.choice.SetInParent()
        message.choice.choices.extend(draw(st.lists(SHORT, max_size=4)))
    return message


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest | pb.GenerateStreamRequest:
    stream = draw(st.booleans())
    message: pb.GenerateRequest | pb.GenerateStreamRequest = (
        pb.GenerateStreamRequest(input=draw(inputs())) if stream else pb.GenerateRequest(inputs=[draw(inputs())])
    )
    message.adapter_id = draw(st.one_of(st.just(""), SHORT))
    message.request_id = draw(REQUEST_ID)
    if draw(st.booleans()):
        message.sampling.CopyFrom(draw(sampling()))
    if draw(st.booleans()):
        message.stopping.max_new_tokens = draw(U32)
    message.stopping.stop_sequences.extend(draw(st.lists(_mostly(SHORT.filter(bool), st.just("")), max_size=3)))
    message.stopping.ignore_eos = draw(st.booleans())
    message.return_options.return_logprobs = draw(st.booleans())
    if draw(st.booleans()):
        message.speculate = draw(st.booleans())
    if draw(st.booleans()):
        message.constraint.CopyFrom(draw(constraints()))
    return message


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_dir)


SETTINGS = Settings(max_new_tokens=64)  # the server's other limits at their defaults


def _convert(
    message: pb.GenerateRequest | pb.GenerateStreamRequest, tokenizer: Tokenizer, seed_offset: int
) -> GenerationRequest:
    """What GenerateStream / Generate do with a message before the engine sees it: the field checks, the prompt,
    the assembly; input ``seed_offset``'s seed rule (seed + i modulo 2**64) is exercised on the same message."""
    call = convert.call_of(message, deadline=None)
    checked = checks.check(call, SETTINGS)
    prompt = prompt_of(call.inputs[0], tokenizer)
    call.sampling.params(logprobs=call.logprobs, offset=seed_offset)
    return checks.engine_request(checked, prompt)


def _check(outcome: GenerationRequest | LoraplexError, tokenizer: Tokenizer) -> None:
    if isinstance(outcome, LoraplexError):
        assert isinstance(outcome, InvalidRequest), outcome
        return
    outcome.sampling.validate()
    # A prompt may tokenize to nothing (found by the long run: text "\x16"): Engine.validate refuses it with
    # InvalidRequest before submission ("the prompt is empty"), so conversion may hand it on.
    assert all(0 <= i < tokenizer.vocab_size for i in outcome.prompt_ids)
    assert 1 <= len(outcome.request_id) <= 128 and all(s for s in outcome.stop_sequences)


@fuzz_settings()
@given(message=requests(), seed_offset=st.integers(0, 64))
def test_valid_looking_messages_convert_or_raise_typed_errors(
    tokenizer: Tokenizer, message: pb.GenerateRequest | pb.GenerateStreamRequest, seed_offset: int
) -> None:
    _check(typed_outcome(lambda: _convert(message, tokenizer, seed_offset)), tokenizer)


@st.composite
def damaged_wire(draw: st.DrawFn) -> tuple[type[pb.GenerateRequest] | type[pb.GenerateStreamRequest], bytes]:
    message = draw(requests())
    raw = bytearray(message.SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw(st.integers(0, len(raw)))
        if how == "flip" and at < len(raw):
            raw[at] = draw(st.integers(0, 255))
        elif how == "cut":
            del raw[at : at + draw(st.integers(1, 8))]
        else:
            raw[at:at] = draw(st.binary(min_size=1, max_size=8))
    return type(message), bytes(raw)


@fuzz_settings()
@given(case=damaged_wire(), seed_offset=st.integers(0, 64))
def test_damaged_wire_bytes_convert_or_raise_typed_errors(
    tokenizer: Tokenizer,
    case: tuple[type[pb.GenerateRequest] | type[pb.GenerateStreamRequest], bytes],
    seed_offset: int,
) -> None:
    cls, raw = case
    try:
        message = cls.FromString(raw)
    except DecodeError:
        event("DecodeError")  # refused by the parser: the transport edge maps that, not convert
        return
    if isinstance(message, pb.GenerateRequest) and not message.inputs:
        event("no inputs")  # the servicer refuses it before conversion
        return
    _check(typed_outcome(lambda: _convert(message, tokenizer, seed_offset)), tokenizer)
