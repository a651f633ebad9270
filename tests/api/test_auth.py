"""API keys and roles over real loopback gRPC: the key file format, who may call what, what stays open, and that a
key never reaches a log line or an error message."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import loraplex
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from loraplex.v1 import adapters_pb2, adapters_pb2_grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.servers import text_req

from service import cli
from service.api.auth import KeyRing, parse_key_file, required_role
from service.api.server import BackgroundServer
from service.config import ConfigError, Settings
from service.errors import Unauthenticated

GENERATE_KEY, ADMIN_KEY, LEGACY_KEY = "gen-3f9a1c", "adm-7d22e0", "legacy-0b5c"
KEY_FILE = f"""# loraplex API keys
generate:{GENERATE_KEY}

admin:{ADMIN_KEY}
"""


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(KEY_FILE)
    return path


@pytest.fixture(scope="module")
def server_settings(key_file: Path) -> dict[str, object]:
    return {"api_key_file": key_file, "api_keys": (LEGACY_KEY,)}


def auth(key: str | None) -> tuple[tuple[str, str], ...]:
    return () if key is None else (("authorization", f"Bearer {key}"),)


def code_of(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_key_file_format(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(KEY_FILE + "  generate : spaced-key  \n")
    assert parse_key_file(path) == ((GENERATE_KEY, "generate"), (ADMIN_KEY, "admin"), ("spaced-key", "generate"))
    bad_lines = {
        "nocolon": "expected ROLE:KEY",
        "root:x1": "expected ROLE:KEY",
        "admin:": "empty",
        "admin:two words": "whitespace",
        f"admin:{GENERATE_KEY}": "already listed",
    }
    for line, needle in bad_lines.items():
        path.write_text(KEY_FILE + line + "\n")
        with pytest.raises(ConfigError) as err:
            parse_key_file(path)
        message = str(err.value)
        assert "line 5" in message and needle in message and str(path) in message
        assert GENERATE_KEY not in message and "x1" not in message  # a key is never echoed
    with pytest.raises(ConfigError, match="cannot read"):
        parse_key_file(tmp_path / "absent")


def test_roles_and_the_open_services() -> None:
    ring = KeyRing(((GENERATE_KEY, "generate"), (ADMIN_KEY, "admin")))
    assert ring.role_of(GENERATE_KEY) == "generate" and ring.role_of(ADMIN_KEY) == "admin"
    assert ring.role_of("") is None and ring.role_of(ADMIN_KEY + "x") is None
    assert required_role("/loraplex.v1.Generation/Generate") == "generate"
    assert required_role("/loraplex.v1.Adapters/LoadAdapter") == "admin"
    assert required_role("/grpc.health.v1.Health/Check") is None
    assert required_role("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") is None
    assert GENERATE_KEY not in repr(ring)
    settings = Settings.from_env({"LORAPLEX_API_KEYS": f"{LEGACY_KEY},other", "LORAPLEX_API_KEY_FILE": "/s/keys"})
    assert settings.api_keys == (LEGACY_KEY, "other") and settings.api_key_file == Path("/s/keys")
    assert LEGACY_KEY not in repr(settings)


def test_the_bearer_scheme_is_case_insensitive() -> None:
    ring = KeyRing(((GENERATE_KEY, "generate"),))
    method = "/loraplex.v1.Generation/Generate"
    for value in (f"Bearer {GENERATE_KEY}", f"bearer {GENERATE_KEY}", f"BEARER {GENERATE_KEY}",
                  f"bEaReR \t {GENERATE_KEY} "):  # fmt: skip
        ring.authorize(method, [("authorization", value)])  # RFC 7235: the scheme ignores case
    for value in (GENERATE_KEY, f"Basic {GENERATE_KEY}", f"Bearer{GENERATE_KEY}", "Bearer ", f"Token {GENERATE_KEY}"):
        with pytest.raises(Unauthenticated):
            ring.authorize(method, [("authorization", value)])


def test_a_lowercase_bearer_scheme_is_accepted_over_grpc(channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerationStub(channel)
    for scheme in ("bearer", "BEARER"):
        md = (("authorization", f"{scheme} {GENERATE_KEY}"),)
        assert code_of(lambda md=md: stub.Generate(text_req("hi", 2), metadata=md, timeout=60)) == grpc.StatusCode.OK
    wrong = (("authorization", "bearer wrong"),)
    refused = code_of(lambda: stub.Generate(text_req("hi", 2), metadata=wrong, timeout=60))
    assert refused == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("key", "generation", "admin"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED),
        ("wrong", grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED),
        (GENERATE_KEY, grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED),
        (ADMIN_KEY, grpc.StatusCode.OK, grpc.StatusCode.OK),
        (LEGACY_KEY, grpc.StatusCode.OK, grpc.StatusCode.OK),  # LORAPLEX_API_KEYS: admin keys
    ],
)
def test_who_may_call_what(
    channel: grpc.Channel, key: str | None, generation: grpc.StatusCode, admin: grpc.StatusCode
) -> None:
    md = auth(key)
    stub, adapters = pb_grpc.GenerationStub(channel), adapters_pb2_grpc.AdaptersStub(channel)
    assert code_of(lambda: stub.Generate(text_req("hi", 2), metadata=md, timeout=60)) == generation
    streamed = pb.GenerateStreamRequest(input=pb.Input(text="hi"))
    assert code_of(lambda: list(stub.GenerateStream(streamed, metadata=md, timeout=60))) == generation
    tokenize = pb.TokenizeRequest(input=pb.Input(text="hi"))
    assert code_of(lambda: stub.Tokenize(tokenize, metadata=md, timeout=60)) == generation
    assert code_of(lambda: adapters.ListAdapters(adapters_pb2.ListAdaptersRequest(), metadata=md, timeout=60)) == admin
    load = adapters_pb2.LoadAdapterRequest(id="x", source="/nowhere")
    expected_load = grpc.StatusCode.PERMISSION_DENIED if admin is grpc.StatusCode.OK else admin  # no adapter root
    assert code_of(lambda: adapters.LoadAdapter(load, metadata=md, timeout=60)) == expected_load


def test_health_and_reflection_stay_open(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    (reply,) = reflect.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    assert "loraplex.v1.Generation" in {s.name for s in reply.list_services_response.service}


def _reason(error: grpc.RpcError, key: str) -> str:
    """The refusal's ErrorInfo reason; nothing in its trailers (the rich status included) echoes ``key``."""
    trailers = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    assert all(key.encode() not in (v if isinstance(v, bytes) else v.encode()) for _, v in trailers)
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info) and info.domain == "loraplex" and not info.metadata
    return info.reason


def test_refusals_name_the_problem_and_never_the_key(
    channel: grpc.Channel, server: BackgroundServer, caplog: pytest.LogCaptureFixture
) -> None:
    adapters = adapters_pb2_grpc.AdaptersStub(channel)
    with caplog.at_level(logging.DEBUG), pytest.raises(grpc.RpcError) as err:
        adapters.ListAdapters(adapters_pb2.ListAdaptersRequest(), metadata=auth(GENERATE_KEY), timeout=10)
    assert "admin" in (err.value.details() or "") and GENERATE_KEY not in (err.value.details() or "")
    assert _reason(err.value, GENERATE_KEY) == "PERMISSION_DENIED"
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.GenerationStub(channel).Generate(text_req("hi", 2), metadata=auth("wrong-key-123"), timeout=10)
    assert "authorization: Bearer" in (err.value.details() or "") and "wrong-key-123" not in (err.value.details() or "")
    assert _reason(err.value, "wrong-key-123") == "UNAUTHENTICATED"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert GENERATE_KEY not in logged and ADMIN_KEY not in logged
    assert GENERATE_KEY not in repr(server.settings) and LEGACY_KEY not in repr(server.settings)


def test_the_python_client_and_cli_send_the_key(
    server: BackgroundServer, capsys: pytest.CaptureFixture[str], served_tiny_dir: Path
) -> None:
    with loraplex.Client(server.target, api_key=GENERATE_KEY, timeout=30) as client:
        assert client.generate("hi", max_new_tokens=2).usage.generated_tokens >= 1
        with pytest.raises(loraplex.PermissionDenied):
            client.list_adapters()
    assert cli.main(["info", "--target", server.target, "--api-key", GENERATE_KEY]) == 0
    assert served_tiny_dir.name in capsys.readouterr().out
    assert cli.main(["adapters", "--target", server.target, "--api-key", ADMIN_KEY, "list"]) == 0
    assert cli.main(["info", "--target", server.target]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err.upper()


def test_a_bad_key_file_stops_serve_with_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "keys"
    bad.write_text("generate:fine\nsuperuser:secret-9\n")
    args = ["serve", "--model", str(tmp_path), "--port", "0", "--metrics-port", "-1", "--api-key-file", str(bad)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"{bad}, line 2" in err and "secret-9" not in err
