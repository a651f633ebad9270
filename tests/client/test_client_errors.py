"""Error mapping and wire metadata of Client / AsyncClient against a real gRPC server on loopback.

The server registers generic handlers for every loraplex.v1 method that record what arrived (raw
request bytes, metadata) and then abort with the status code named in the request's ``x-test-code``
metadata, so every ``grpc.RpcError`` here is real: real status codes, messages and trailing metadata (with a
``google.rpc.Status`` carrying an ``ErrorInfo``, as the loraplex server sends).
It never answers a generation; the real servicer is tested elsewhere. Health uses the real
grpcio-health-checking servicer.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import loraplex
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from loraplex.v1 import adapters_pb2, generation_pb2

CODE_HEADER = "x-test-code"
AFTER_FIRST_HEADER = "x-test-after-first"  # stream: send one message, then abort
SLEEP_HEADER = "x-test-sleep"

# The contract: these codes have their own class; every other non-OK code raises LoraplexError itself.
OWN_CLASS = {
    grpc.StatusCode.INVALID_ARGUMENT: loraplex.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: loraplex.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: loraplex.AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: loraplex.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: loraplex.ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: loraplex.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: loraplex.DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: loraplex.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: loraplex.PermissionDenied,
    grpc.StatusCode.CANCELLED: loraplex.Cancelled,
    grpc.StatusCode.UNIMPLEMENTED: loraplex.Unimplemented,
    grpc.StatusCode.INTERNAL: loraplex.Internal,
}
ERROR_CODES = [code for code in grpc.StatusCode if code is not grpc.StatusCode.OK]


@dataclass
class Recorder:
    """What the server received, per full method name."""

    calls: list[tuple[str, bytes, dict[str, str | bytes]]] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # methods whose RPC terminated (any way), in order
    lock: threading.Lock = field(default_factory=threading.Lock)

    def last(self, method: str) -> tuple[bytes, dict[str, str | bytes]]:
        with self.lock:
            for name, request, metadata in reversed(self.calls):
                if name == method:
                    return request, metadata
        raise AssertionError(f"{method} was never called")


def _abort(context: grpc.ServicerContext, metadata: dict[str, str | bytes]) -> None:
    if SLEEP_HEADER in metadata:
        time.sleep(float(metadata[SLEEP_HEADER]))
    code = grpc.StatusCode[str(metadata.get(CODE_HEADER, "INTERNAL"))]
    info = error_details_pb2.ErrorInfo(reason="TEST_REASON", domain="loraplex", metadata={"field": "x.y", "limit": "3"})
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code.value[0], message=f"test abort {code.name}", details=[detail])
    trailing = (
        ("x-detail", "why"),
        ("x-blob-bin", b"\x00\x01"),
        ("grpc-status-details-bin", status.SerializeToString()),
    )
    context.set_trailing_metadata(trailing)
    context.abort(code, f"test abort {code.name}")


def _handlers(service: str, methods: dict[str, bool], recorder: Recorder) -> grpc.GenericRpcHandler:
    def unary(name: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            metadata = dict(context.invocation_metadata())
            with recorder.lock:
                recorder.calls.append((f"/{service}/{name}", request, metadata))
            _abort(context, metadata)
            raise AssertionError("abort returned")

        return handle

    def streaming(name: str) -> Callable[[bytes, grpc.ServicerContext], Iterator[bytes]]:
        def handle(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            metadata = dict(context.invocation_metadata())
            with recorder.lock:
                recorder.calls.append((f"/{service}/{name}", request, metadata))
            context.add_callback(lambda: recorder.ended.append(f"/{service}/{name}"))
            if AFTER_FIRST_HEADER in metadata:
                yield generation_pb2.GenerateStreamResponse(text="Hel", request_id="r-1").SerializeToString()
            _abort(context, metadata)

        return handle

    handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
        name: grpc.unary_stream_rpc_method_handler(streaming(name))
        if is_stream
        else grpc.unary_unary_rpc_method_handler(unary(name))
        for name, is_stream in methods.items()
    }
    return grpc.method_handlers_generic_handler(service, handlers)


@dataclass
class Server:
    target: str
    recorder: Recorder
    health: health.HealthServicer


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    recorder = Recorder()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    generation_methods = generation_pb2.DESCRIPTOR.services_by_name["Generation"].methods
    adapter_methods = adapters_pb2.DESCRIPTOR.services_by_name["Adapters"].methods
    grpc_server.add_generic_rpc_handlers(
        (
            _handlers("loraplex.v1.Generation", {m.name: m.server_streaming for m in generation_methods}, recorder),
            _handlers("loraplex.v1.Adapters", {m.name: m.server_streaming for m in adapter_methods}, recorder),
        )
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        yield Server(f"127.0.0.1:{port}", recorder, health_servicer)
    finally:
        grpc_server.stop(grace=None)


def _client(server: Server, code: grpc.StatusCode, **kwargs: Any) -> loraplex.Client:
    metadata = [(CODE_HEADER, code.name), *kwargs.pop("metadata", [])]
    return loraplex.Client(server.target, timeout=10, metadata=metadata, **kwargs)


def _check(error: loraplex.LoraplexError, code: grpc.StatusCode) -> None:
    assert type(error) is OWN_CLASS.get(code, loraplex.LoraplexError)
    assert type(error) is loraplex.error_class(code)
    assert error.code is code
    assert error.message == f"test abort {code.name}"
    assert error.trailing_metadata["x-detail"] == "why"
    assert error.trailing_metadata["x-blob-bin"] == b"\x00\x01"
    assert error.reason == "TEST_REASON" and error.domain == "loraplex"
    assert dict(error.details) == {"field": "x.y", "limit": "3"}
    assert code.name in str(error)


# ---------------------------------------------------------------------------------------------- sync


@pytest.mark.parametrize("code", ERROR_CODES, ids=lambda c: c.name)
def test_every_status_code_maps_to_its_class(server: Server, code: grpc.StatusCode) -> None:
    with _client(server, code) as client, pytest.raises(loraplex.LoraplexError) as caught:
        client.generate("hello")
    _check(caught.value, code)
    assert isinstance(caught.value.__cause__, grpc.RpcError)


CALLS: dict[str, Callable[[loraplex.Client], object]] = {
    "Generate": lambda c: c.generate(["a", "b"]),
    "GenerateStream": lambda c: list(c.stream("a")),
    "Tokenize": lambda c: c.tokenize("a"),
    "ModelInfo": lambda c: c.model_info(),
    "LoadAdapter": lambda c: c.load_adapter("sql", "/adapters/sql"),
    "UnloadAdapter": lambda c: c.unload_adapter("sql"),
    "ListAdapters": lambda c: c.list_adapters(),
    "GetAdapter": lambda c: c.get_adapter("sql"),
}


@pytest.mark.parametrize("method", sorted(CALLS))
def test_every_method_raises_mapped_errors(server: Server, method: str) -> None:
    with _client(server, grpc.StatusCode.NOT_FOUND) as client, pytest.raises(loraplex.NotFound) as caught:
        CALLS[method](client)
    _check(caught.value, grpc.StatusCode.NOT_FOUND)


def test_generate_request_and_metadata_on_the_wire(server: Server) -> None:
    code = grpc.StatusCode.UNAVAILABLE
    with _client(server, code, api_key="secret", metadata=[("x-team", "t")]) as client:
        with pytest.raises(loraplex.Unavailable):
            client.generate(["a", [{"role": "user", "content": "b"}]], adapter="sql-lora", seed=3, stop="\n")
        raw, metadata = server.recorder.last("/loraplex.v1.Generation/Generate")
        assert metadata[loraplex.ADAPTER_HEADER] == "sql-lora"
        assert metadata["authorization"] == "Bearer secret"
        assert metadata["x-team"] == "t"
        request = generation_pb2.GenerateRequest.FromString(raw)
        assert request.adapter_id == "sql-lora" and request.sampling.seed == 3
        assert [i.WhichOneof("kind") for i in request.inputs] == ["text", "messages"]
        assert list(request.stopping.stop_sequences) == ["\n"]

        with pytest.raises(loraplex.Unavailable):
            client.generate("base model")  # the header is sent for the base model too, empty
        _, metadata = server.recorder.last("/loraplex.v1.Generation/Generate")
        assert metadata[loraplex.ADAPTER_HEADER] == ""

        with pytest.raises(loraplex.Unavailable):
            client.tokenize("x")
        _, metadata = server.recorder.last("/loraplex.v1.Generation/Tokenize")
        assert loraplex.ADAPTER_HEADER not in metadata and metadata["authorization"] == "Bearer secret"


def test_stream_error_after_first_delta(server: Server) -> None:
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    with _client(server, code, metadata=[(AFTER_FIRST_HEADER, "1")]) as client:
        deltas = client.stream("hi", adapter="x")
        first = next(deltas)
        assert first.text == "Hel" and first.request_id == "r-1" and not first.is_last
        with pytest.raises(loraplex.ResourceExhausted) as caught:
            next(deltas)
    _check(caught.value, code)
    _, metadata = server.recorder.last("/loraplex.v1.Generation/GenerateStream")
    assert metadata[loraplex.ADAPTER_HEADER] == "x"


def test_stream_starts_on_iteration_and_closing_it_cancels_the_call(server: Server) -> None:
    method = "/loraplex.v1.Generation/GenerateStream"
    headers = [(AFTER_FIRST_HEADER, "1"), (SLEEP_HEADER, "3")]
    with _client(server, grpc.StatusCode.INTERNAL, metadata=headers) as client:
        calls_before = len(server.recorder.calls)
        unused = client.stream("never iterated")
        del unused
        assert len(server.recorder.calls) == calls_before  # no RPC was started

        deltas = client.stream("hi")
        assert next(deltas).text == "Hel"
        ended_before = server.recorder.ended.count(method)
        start = time.monotonic()
        deltas.close()  # the handler is still sleeping: only a cancel can end the RPC this soon
        while server.recorder.ended.count(method) == ended_before and time.monotonic() - start < 2.5:
            time.sleep(0.01)
        assert server.recorder.ended.count(method) == ended_before + 1, "closing the stream did not cancel it"


def test_real_deadline_and_unreachable_server(server: Server) -> None:
    with (
        _client(server, grpc.StatusCode.INTERNAL, metadata=[(SLEEP_HEADER, "1.0")]) as client,
        pytest.raises(loraplex.DeadlineExceeded) as caught,
    ):
        client.model_info(timeout=0.1)
    assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED

    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    with loraplex.Client(f"127.0.0.1:{free_port}") as client, pytest.raises(loraplex.Unavailable) as caught_u:
        client.model_info(timeout=5)
    assert caught_u.value.code is grpc.StatusCode.UNAVAILABLE


def test_health_against_grpc_health_servicer(server: Server) -> None:
    with loraplex.Client(server.target, timeout=5) as client:
        server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert client.health() is loraplex.HealthStatus.NOT_SERVING
        server.health.set("", health_pb2.HealthCheckResponse.SERVING)
        assert client.health() is loraplex.HealthStatus.SERVING
        with pytest.raises(loraplex.NotFound):  # grpc_health answers NOT_FOUND for an unknown service
            client.health("no.such.Service")


def test_passed_in_channel_is_left_open(server: Server) -> None:
    channel = grpc.insecure_channel(server.target)
    with loraplex.Client(channel=channel, metadata=[(CODE_HEADER, "ABORTED")]) as client:
        with pytest.raises(loraplex.LoraplexError) as caught:
            client.list_adapters(timeout=5)
        assert caught.value.code is grpc.StatusCode.ABORTED
    with loraplex.Client(channel=channel) as again:
        assert again.health(timeout=5) in (loraplex.HealthStatus.SERVING, loraplex.HealthStatus.NOT_SERVING)
    channel.close()


# --------------------------------------------------------------------------------------------- async


def test_async_client_maps_errors_and_sends_metadata(server: Server) -> None:
    async def scenario() -> None:
        for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.DATA_LOSS):
            async with loraplex.AsyncClient(
                server.target, timeout=10, metadata=[(CODE_HEADER, code.name)], api_key="k"
            ) as client:
                with pytest.raises(loraplex.LoraplexError) as caught:
                    await client.generate("a", adapter="med")
                _check(caught.value, code)
                _, metadata = server.recorder.last("/loraplex.v1.Generation/Generate")
                assert metadata[loraplex.ADAPTER_HEADER] == "med" and metadata["authorization"] == "Bearer k"
                for call in (
                    client.tokenize("a"),
                    client.model_info(),
                    client.load_adapter("a", "/p"),
                    client.unload_adapter("a"),
                    client.list_adapters(),
                    client.get_adapter("a"),
                ):
                    with pytest.raises(loraplex.LoraplexError) as caught:
                        await call
                    _check(caught.value, code)

        async with loraplex.AsyncClient(
            server.target, metadata=[(CODE_HEADER, "CANCELLED"), (AFTER_FIRST_HEADER, "1")]
        ) as client:
            texts = []
            with pytest.raises(loraplex.Cancelled) as caught_stream:
                async for delta in client.stream("hi", adapter="x"):
                    texts.append(delta.text)
            assert texts == ["Hel"]
            _check(caught_stream.value, grpc.StatusCode.CANCELLED)
            with pytest.raises(TypeError):  # checked when stream() is called, before any RPC
                client.stream(["a", "b"])  # type: ignore[list-item]
            server.health.set("", health_pb2.HealthCheckResponse.SERVING)
            assert await client.health(timeout=5) is loraplex.HealthStatus.SERVING

    asyncio.run(scenario())


def test_undecodable_status_details_are_ignored() -> None:
    from loraplex._errors import error_info

    assert error_info(None) is None and error_info("text") is None
    assert error_info(b"\x0a\xff\xff") is None  # truncated google.rpc.Status: no crash, just no details
    assert error_info(status_pb2.Status(code=5, message="no details").SerializeToString()) is None
