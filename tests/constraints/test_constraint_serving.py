"""Constraints on a real server (tiny model, loopback gRPC): the compile-time limit, a hostile constraint beside
running streams, and a full batch of rows that each bring their own schema."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import grpc
import jsonschema
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.wait import wait_until


def _generate(stub: pb_grpc.GenerationStub, constraint: pb.Constraint, n: int = 24) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        inputs=[pb.Input(text="Answer")], stopping=pb.StoppingCriteria(max_new_tokens=n), constraint=constraint
    )
    return stub.Generate(request, timeout=60)


def test_a_compile_over_the_time_limit_is_refused_and_its_result_cached(tiny_server: Callable[..., Any]) -> None:
    srv = tiny_server(max_constraint_compile_seconds=0.001)
    # nested repeats: building this regex's lexer takes a good fraction of a second, far past the limit (a compile
    # that ends before the event loop next looks at the clock is accepted: the limit bounds the wait)
    pattern = "(a{150}){150}"
    constraint = pb.Constraint(regex=pattern)
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            _generate(stub, constraint)
            raise AssertionError("a compile past the limit was not refused")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "--max-constraint-compile-seconds" in (exc.details() or "")

        def served() -> bool:  # the compile went on in the background; once cached, the same pattern is served
            try:
                reply = _generate(stub, constraint)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                return False
            assert set(reply.results[0].text) <= {"a"}
            return True

        assert wait_until(served, timeout=60, poll=0.05)


def test_a_hostile_constraint_does_not_hold_up_running_streams(tiny_server: Callable[..., Any]) -> None:
    """A regex whose lexer is costly to build compiles on the compile pool while a stream keeps getting tokens."""
    srv = tiny_server(max_new_tokens=900, max_total_tokens=1000, max_prompt_tokens=64)
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        stream = stub.GenerateStream(
            pb.GenerateStreamRequest(
                input=pb.Input(text="Long"), stopping=pb.StoppingCriteria(max_new_tokens=900, ignore_eos=True)
            ),
            timeout=120,
        )
        next(iter(stream))  # the stream runs
        outcome: dict[str, object] = {}

        def hostile() -> None:
            try:
                outcome["reply"] = _generate(stub, pb.Constraint(regex="(a{300}){300}"), n=4)
            except grpc.RpcError as exc:
                outcome["code"] = exc.code()

        worker = threading.Thread(target=hostile)
        worker.start()
        tokens = sum(len(m.token_ids) or 1 for m in stream)  # the stream finishes while the compile runs
        worker.join(60)
        assert tokens >= 800
        assert "reply" in outcome or outcome.get("code") == grpc.StatusCode.INVALID_ARGUMENT, outcome


def test_a_full_batch_of_rows_each_with_its_own_schema(tiny_server: Callable[..., Any]) -> None:
    srv = tiny_server(max_batch_size=8)
    schemas = [
        {"type": "object", "properties": {f"key{i}": {"type": "integer"}}, "required": [f"key{i}"],
         "additionalProperties": False}
        for i in range(8)
    ]  # fmt: skip
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        replies: list[pb.GenerateResponse] = [pb.GenerateResponse()] * 8

        def one(i: int) -> None:
            replies[i] = _generate(stub, pb.Constraint(json_schema=json.dumps(schemas[i])), n=40)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for schema, reply in zip(schemas, replies, strict=True):
        result = reply.results[0]
        if result.finish_reason == pb.FINISH_REASON_EOS:
            jsonschema.validate(json.loads(result.text), schema)
        else:
            assert result.finish_reason == pb.FINISH_REASON_LENGTH
            assert result.text.startswith("{")
