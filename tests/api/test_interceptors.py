"""The interceptor chain on its own: a real ``grpc.aio`` server on loopback with the server's chain in front of
plain handlers that fail on purpose (no model), so what each interceptor adds is seen exactly: a bug becomes
INTERNAL naming only its exception type, logged once with its traceback; a typed error raised mid-stream arrives
after the replies before it, with its ErrorInfo; both are counted once in ``loraplex_requests_total`` and per
adapter; a service outside the loraplex ones is left alone (grpc's own UNKNOWN, not counted)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from loraplex.v1 import generation_pb2 as pb

from service import metrics
from service.api import interceptors
from service.api.auth import KeyRing
from service.errors import InvalidRequest

GENERATION = "loraplex.v1.Generation"


def count(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def _boom(request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
    raise RuntimeError("secret internals")


async def _two_then_invalid(request: pb.GenerateStreamRequest, context: Any) -> AsyncIterator[Any]:
    yield pb.GenerateStreamResponse(text="a")
    yield pb.GenerateStreamResponse(text="b")
    raise InvalidRequest("no more", field="stopping.stop_sequences", limit=2)


def _other(request: bytes, context: Any) -> bytes:
    raise RuntimeError("not ours")


def _handlers() -> list[grpc.GenericRpcHandler]:
    generation = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            _boom, pb.GenerateRequest.FromString, pb.GenerateResponse.SerializeToString
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            _two_then_invalid, pb.GenerateStreamRequest.FromString, pb.GenerateStreamResponse.SerializeToString
        ),
    }
    other = {"Boom": grpc.unary_unary_rpc_method_handler(_other)}
    return [
        grpc.method_handlers_generic_handler(GENERATION, generation),
        grpc.method_handlers_generic_handler("test.Other", other),
    ]


def info_of(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info


async def _exercise() -> dict[str, Any]:
    chain = interceptors.chain(KeyRing(), services=(GENERATION,), known_adapter=lambda adapter_id: False)
    server = grpc.aio.server(interceptors=chain)
    server.add_generic_rpc_handlers(_handlers())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    seen: dict[str, Any] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            generate = channel.unary_unary(
                f"/{GENERATION}/Generate",
                request_serializer=pb.GenerateRequest.SerializeToString,
                response_deserializer=pb.GenerateResponse.FromString,
            )
            try:
                await generate(pb.GenerateRequest(adapter_id="someone"), timeout=10)
            except grpc.aio.AioRpcError as error:
                seen["bug"] = error
            stream = channel.unary_stream(
                f"/{GENERATION}/GenerateStream",
                request_serializer=pb.GenerateStreamRequest.SerializeToString,
                response_deserializer=pb.GenerateStreamResponse.FromString,
            )
            replies: list[str] = []
            try:
                async for reply in stream(pb.GenerateStreamRequest(), timeout=10):
                    replies.append(reply.text)
            except grpc.aio.AioRpcError as error:
                seen["stream"] = error
            seen["replies"] = replies
            try:
                await channel.unary_unary("/test.Other/Boom")(b"", timeout=10)
            except grpc.aio.AioRpcError as error:
                seen["other"] = error
    finally:
        await server.stop(None)
    return seen


def test_the_chain_maps_counts_and_leaves_others_alone(caplog: pytest.LogCaptureFixture) -> None:
    before = {
        "internal": count("loraplex_requests_total", method="Generate", code="INTERNAL"),
        "invalid": count("loraplex_requests_total", method="GenerateStream", code="INVALID_ARGUMENT"),
        "other": count("loraplex_requests_total", method="Boom", code="UNKNOWN"),
        "adapter": count("loraplex_adapter_requests_total", adapter="other", code="INTERNAL"),
    }
    with caplog.at_level(logging.ERROR, logger="loraplex.api"):
        seen = asyncio.run(_exercise())

    bug = seen["bug"]
    assert bug.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError" in bug.details() and "secret internals" not in bug.details()
    info = info_of(bug)
    assert (info.reason, info.domain, dict(info.metadata)) == ("INTERNAL", "loraplex", {"exception": "RuntimeError"})
    bug_logs = [r for r in caplog.records if r.name == "loraplex.api" and r.exc_info]
    assert len(bug_logs) == 1 and "Generate" in bug_logs[0].getMessage()

    assert seen["replies"] == ["a", "b"]
    stream = seen["stream"]
    assert stream.code() == grpc.StatusCode.INVALID_ARGUMENT and stream.details() == "no more"
    info = info_of(stream)
    assert info.reason == "INVALID_REQUEST"
    assert dict(info.metadata) == {"field": "stopping.stop_sequences", "limit": "2"}

    assert seen["other"].code() == grpc.StatusCode.UNKNOWN
    assert count("loraplex_requests_total", method="Generate", code="INTERNAL") - before["internal"] == 1
    assert count("loraplex_requests_total", method="GenerateStream", code="INVALID_ARGUMENT") - before["invalid"] == 1
    assert count("loraplex_requests_total", method="Boom", code="UNKNOWN") == before["other"] == 0
    assert count("loraplex_adapter_requests_total", adapter="other", code="INTERNAL") - before["adapter"] == 1


def test_a_status_that_can_no_longer_be_sent_ends_the_call_as_cancelled(caplog: pytest.LogCaptureFixture) -> None:
    """The engine's own deadline check can fire a moment before gRPC's: the status is then sent on a call that the
    core has already ended, and ``context.abort`` fails inside gRPC (ExecuteBatchError, an ``InternalError``).
    Seen in CI as an ERROR traceback from test_edge's deadline test; the call must end as cancelled (counted once,
    as its error's code) without an error log."""
    from grpc._cython import cygrpc

    from service.api import status
    from service.errors import DeadlineExceeded

    class EndedCall:  # the one method status.abort uses, failing as gRPC's does on an ended call
        async def abort(self, *args: object) -> None:
            raise cygrpc.ExecuteBatchError("Failed execute_batch")

    sample = metrics.REQUESTS.labels("Generate", "DEADLINE_EXCEEDED")
    before = sample._value.get()
    with caplog.at_level(logging.WARNING), pytest.raises(asyncio.CancelledError):
        asyncio.run(status.abort(EndedCall(), "Generate", DeadlineExceeded("late")))  # type: ignore[arg-type]
    assert sample._value.get() == before + 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
