"""The server's edge over real loopback gRPC: malformed bytes, deadlines in the metrics, message size, connection
ageing, and which adapter folders a server may read."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import pytest
from loraplex.v1 import adapters_pb2, adapters_pb2_grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.adapter_files import write_peft_adapter
from support.metrics import requests_total
from support.servers import stream_req, text_req, tiny_settings

from service.api.server import BackgroundServer, grpc_options
from service.bootstrap import adapter_roots
from service.config import Settings

MESSAGE_LIMIT = 8 << 10  # small enough for a reply to outgrow it from a prompt under --max-prompt-bytes


@pytest.fixture(scope="module")
def server_settings() -> dict[str, object]:
    return {"metrics_port": 0, "max_message_bytes": MESSAGE_LIMIT, "max_new_tokens": 1000, "max_total_tokens": 1024}


def raw_call(channel: grpc.Channel, method: str, data: bytes, *, stream: bool = False) -> grpc.RpcError:
    """Send ``data`` as the request bytes of ``method`` (no serializer: the bytes go out as they are)."""
    if stream:
        call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            list(call(data, timeout=30))
    else:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(method, request_serializer=None, response_deserializer=None)(data, timeout=30)
    return err.value


def _bad_utf8() -> bytes:
    good = pb.TokenizeRequest(input=pb.Input(text="AAAA")).SerializeToString()
    return good.replace(b"AAAA", b"\xff\xfe\xc0\x80")


CORRUPT = {
    "bad utf-8 in a string": _bad_utf8(),
    "length past the end": b"\x0a\xff\xff\xff\x0f",  # field 1, length-delimited, length 2^32 - 1
    "truncated varint": b"\x08\xff\xff",
    "wire type 7": b"\x0f",
}


@pytest.mark.parametrize("data", CORRUPT.values(), ids=CORRUPT.keys())
@pytest.mark.parametrize(
    ("method", "stream"),
    [
        ("/loraplex.v1.Generation/Tokenize", False),
        ("/loraplex.v1.Generation/Generate", False),
        ("/loraplex.v1.Generation/GenerateStream", True),
        ("/loraplex.v1.Adapters/GetAdapter", False),
    ],
)
def test_malformed_bytes_are_invalid_argument_without_an_error_log(
    channel: grpc.Channel, caplog: pytest.LogCaptureFixture, method: str, stream: bool, data: bytes
) -> None:
    with caplog.at_level(logging.WARNING):
        error = raw_call(channel, method, data, stream=stream)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "protobuf" in (error.details() or "")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert any("malformed_request" in r.getMessage() for r in caplog.records)
    stub = pb_grpc.GenerationStub(channel)  # ... and the server keeps serving
    assert stub.Generate(text_req("still fine", 2), timeout=60).results[0].usage.generated_tokens == 2


def test_client_deadline_counts_as_deadline_exceeded(
    server: BackgroundServer, channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    """Streams are cut by the deadline while a reply is on its way as often as while one is awaited: both must
    count as DEADLINE_EXCEEDED, and neither may log an ERROR."""
    stub = pb_grpc.GenerationStub(channel)
    methods = ("GenerateStream", "Generate")
    codes = ("DEADLINE_EXCEEDED", "CANCELLED")
    calls = 8
    before = {(m, c): requests_total(server, m, c) for m in methods for c in codes}
    with caplog.at_level(logging.WARNING):
        for _ in range(calls):  # 1000 tokens take far longer than the deadline on any machine
            with pytest.raises(grpc.RpcError) as err:
                list(stub.GenerateStream(stream_req("slow", 1000), timeout=0.15))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(text_req("slow", 1000), timeout=0.15)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.3)  # the server notices the deadline a moment after the client
    delta = {key: requests_total(server, *key) - old for key, old in before.items()}
    assert delta == {(m, c): (calls if c == "DEADLINE_EXCEEDED" else 0) for m in methods for c in codes}
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    engine = server.server.runtime.loaded.engine  # type: ignore[union-attr]
    assert engine.in_flight == 0  # every cut stream gave its slot back


def test_a_cancelled_call_still_counts_as_cancelled(server: BackgroundServer, channel: grpc.Channel) -> None:
    before = requests_total(server, "GenerateStream", "CANCELLED")
    call = pb_grpc.GenerationStub(channel).GenerateStream(stream_req("cancel me", 250), timeout=60)
    next(call)
    call.cancel()
    time.sleep(0.3)
    assert requests_total(server, "GenerateStream", "CANCELLED") - before == 1


def test_oversize_request_is_resource_exhausted_and_the_server_keeps_serving(channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerationStub(channel)
    big = pb.TokenizeRequest(input=pb.Input(text="a" * (MESSAGE_LIMIT + 1)))
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(big, timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Tokenize(pb.TokenizeRequest(input=pb.Input(text="a" * 1000)), timeout=30).token_ids
    assert stub.Generate(text_req("still fine", 2), timeout=60).results[0].usage.generated_tokens == 2


def test_message_limit_applies_to_replies_too(channel: grpc.Channel) -> None:
    """A reply over the limit is refused by the server itself (its send limit), not sent."""
    stub = pb_grpc.GenerationStub(channel)
    text = "a b " * (MESSAGE_LIMIT // 8)  # under the limit going in; ids + token strings coming back are larger
    assert len(pb.TokenizeRequest(input=pb.Input(text=text)).SerializeToString()) < MESSAGE_LIMIT
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(pb.TokenizeRequest(input=pb.Input(text=text)), timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_grpc_options_follow_the_settings() -> None:
    options = dict(grpc_options(Settings(max_message_bytes=1 << 20)))
    assert options["grpc.max_receive_message_length"] == options["grpc.max_send_message_length"] == 1 << 20
    assert options["grpc.max_connection_age_ms"] == 300_000
    assert "grpc.max_connection_age_grace_ms" not in options  # unlimited: running calls are never cut
    assert "grpc.max_connection_age_ms" not in dict(grpc_options(Settings(max_connection_age_seconds=0)))
    assert dict(grpc_options(Settings(max_connection_age_grace_seconds=2.5)))["grpc.max_connection_age_grace_ms"] == (
        2500
    )


AGE = 0.05  # seconds: far shorter than a STREAM_TOKENS stream on any machine (engine steps take ~1 ms or more)
STREAM_TOKENS = 250  # within tiny_settings max_new_tokens


def _long_stream(target: str) -> tuple[list[pb.GenerateStreamResponse], float]:
    start = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        chunks = list(stub.GenerateStream(stream_req("a long story", STREAM_TOKENS), timeout=120))
        # The aged connection is replaced: the same channel keeps working.
        assert stub.Generate(text_req("after", 2), timeout=60).results[0].usage.generated_tokens == 2
    return chunks, time.monotonic() - start


def test_connection_ageing_never_cuts_a_running_stream(served_tiny_dir: Path) -> None:
    settings = tiny_settings(served_tiny_dir, max_connection_age_seconds=AGE)
    with BackgroundServer(settings) as srv:
        chunks, seconds = _long_stream(srv.target)
    assert seconds > 3 * AGE, "the stream must outlive the connection's age for this test to mean anything"
    assert sum(len(c.token_ids) for c in chunks) == STREAM_TOKENS
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_short_age_grace_does_cut_streams(served_tiny_dir: Path) -> None:
    """The control for the test above: with a grace shorter than the stream, ageing cuts it (so the test above can
    tell a cut from a finish)."""
    settings = tiny_settings(served_tiny_dir, max_connection_age_seconds=AGE, max_connection_age_grace_seconds=AGE)
    with BackgroundServer(settings) as srv, pytest.raises(grpc.RpcError) as err:
        _long_stream(srv.target)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------------------------------------ adapter roots


def test_adapter_root_adds_to_the_operators_folders(tmp_path: Path) -> None:
    demo, root, own = tmp_path / "demo", tmp_path / "root", tmp_path / "own" / "x"
    settings = Settings(adapter_dirs=(demo,), adapter_roots=(root,), adapters=(("x", own),))
    assert adapter_roots(settings) == (demo, own.parent, root)
    assert adapter_roots(Settings(adapter_dirs=(demo,))) == (demo,)
    assert adapter_roots(Settings(adapter_roots=(root, root))) == (root,)


def test_adapter_root_keeps_the_adapter_dir_adapters_over_grpc(tmp_path: Path, served_tiny_dir: Path) -> None:
    demo, root = tmp_path / "demo", tmp_path / "uploads"
    write_peft_adapter(demo / "caps", served_tiny_dir, r=2, seed=1)
    write_peft_adapter(root / "later", served_tiny_dir, r=2, seed=2)
    settings = tiny_settings(served_tiny_dir, adapter_dirs=(demo,), adapter_roots=(root,))
    with BackgroundServer(settings) as srv, grpc.insecure_channel(srv.target) as ch:
        admin = adapters_pb2_grpc.AdaptersStub(ch)
        assert [a.id for a in admin.ListAdapters(adapters_pb2.ListAdaptersRequest(), timeout=30).adapters] == ["caps"]
        admin.LoadAdapter(adapters_pb2.LoadAdapterRequest(id="later", source=str(root / "later")), timeout=30)
        listed = admin.ListAdapters(adapters_pb2.ListAdaptersRequest(), timeout=30).adapters
        assert sorted(a.id for a in listed) == ["caps", "later"]
        assert {a.tier for a in listed} == {adapters_pb2.ADAPTER_TIER_DISK}
        stub = pb_grpc.GenerationStub(ch)
        for adapter in ("caps", "later"):
            reply = stub.Generate(text_req("hi", 2, adapter_id=adapter), timeout=60)
            assert reply.results[0].usage.generated_tokens == 2
        listed = admin.ListAdapters(adapters_pb2.ListAdaptersRequest(), timeout=30).adapters
        for a in listed:  # residency as the store says: on the device after one use, never evicted yet
            assert (a.kind, a.tier, a.loads, a.evictions, a.dora) == (
                adapters_pb2.ADAPTER_KIND_LORA,
                adapters_pb2.ADAPTER_TIER_DEVICE,
                1,
                0,
                False,
            ), a.id
            assert a.device_bytes > 0 and a.host_bytes > 0 and a.HasField("last_used")
        with pytest.raises(grpc.RpcError) as err:  # outside every root: still refused
            admin.LoadAdapter(adapters_pb2.LoadAdapterRequest(id="y", source=str(tmp_path)), timeout=30)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
