"""Request ids and access lines, read from the real log output of a real server over loopback.

In process: the server's records go through ``service.logs.handler("json")`` into a buffer, parsed line by line.
Out of process: `loraplex serve --log-format json` writes them to stderr. Either way a client-sent id must appear
in its request's access line, in the response metadata and in the error trailers.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from loraplex.v1 import adapters_pb2 as apb
from loraplex.v1 import adapters_pb2_grpc as apb_grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.adapter_files import rewrite_adapter_tensors, write_peft_adapter
from support.http_api import base_url, call
from support.servers import stream_req, text_req
from support.wait import wait_until

from service import logs
from service.api.server import BackgroundServer
from service.config import Settings

ACCESS_KEYS = {
    "ts", "level", "logger", "request_id", "message", "method", "adapter", "code", "prompt_tokens",
    "generated_tokens", "ttft_seconds", "duration_seconds", "peer",
}  # fmt: skip


class Captured:
    """The JSON lines the server logged since the test began."""

    def __init__(self, buffer: io.StringIO) -> None:
        self.buffer = buffer

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.buffer.getvalue().splitlines() if line.strip()]

    def access(self, request_id: str, timeout: float = 30.0) -> dict[str, Any]:
        """The access line of ``request_id`` (waiting for it: a stream's line comes when its call has ended)."""
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [r for r in self.lines() if r["logger"] == "loraplex.access" and r["request_id"] == request_id]
            return bool(found)

        assert wait_until(seen, timeout, poll=0.01), f"no access line for {request_id}"
        (line,) = found
        return line


@pytest.fixture
def captured() -> Iterator[Captured]:
    buffer = io.StringIO()
    root = logging.getLogger()
    handler, level = logs.handler("json", buffer), root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield Captured(buffer)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _metadata(pairs: Any) -> dict[str, str]:
    return {k: v for k, v in pairs or () if isinstance(v, str)}


def test_client_id_in_access_line_and_response_metadata(stub: pb_grpc.GenerationStub, captured: Captured) -> None:
    reply, call = stub.Generate.with_call(text_req("Hello there", 6, request_id="client-ok-1"), timeout=60)
    assert reply.request_id == "client-ok-1"
    assert _metadata(call.initial_metadata())["x-request-id"] == "client-ok-1"
    assert _metadata(call.trailing_metadata())["x-request-id"] == "client-ok-1"
    line = captured.access("client-ok-1")
    assert set(line) == ACCESS_KEYS and line["level"] == "INFO" and line["message"] == "event=access"
    assert (line["method"], line["adapter"], line["code"]) == ("Generate", "", "OK")
    assert line["prompt_tokens"] > 0 and line["generated_tokens"] == 6
    assert 0 < line["ttft_seconds"] <= line["duration_seconds"]
    assert line["peer"].startswith("ipv4:127.0.0.1:")


def test_header_id_and_generated_id(stub: pb_grpc.GenerationStub, captured: Captured) -> None:
    reply = stub.Generate(text_req("Hi", 2), metadata=(("x-request-id", "from-header-2"),), timeout=60)
    assert reply.request_id == "from-header-2"
    assert captured.access("from-header-2")["code"] == "OK"

    reply, call = stub.Generate.with_call(text_req("Hi", 2), timeout=60)
    assert re.fullmatch(r"[0-9a-f]{32}", reply.request_id)  # uuid4 hex, made by the server
    assert _metadata(call.initial_metadata())["x-request-id"] == reply.request_id
    assert captured.access(reply.request_id)["generated_tokens"] == 2

    _, call = stub.ModelInfo.with_call(pb.ModelInfoRequest(), metadata=(("x-request-id", "info-3"),), timeout=30)
    assert _metadata(call.initial_metadata())["x-request-id"] == "info-3"
    line = captured.access("info-3")
    assert (line["method"], line["prompt_tokens"], line["ttft_seconds"]) == ("ModelInfo", 0, None)


def test_stream_success_and_cancel(stub: pb_grpc.GenerationStub, captured: Captured) -> None:
    call = stub.GenerateStream(stream_req("Hello there", 5, request_id="stream-4"), timeout=60)
    chunks = list(call)
    assert chunks[0].request_id == "stream-4"
    assert _metadata(call.initial_metadata())["x-request-id"] == "stream-4"  # type: ignore[attr-defined]
    assert _metadata(call.trailing_metadata())["x-request-id"] == "stream-4"  # type: ignore[attr-defined]
    line = captured.access("stream-4")
    assert (line["method"], line["code"], line["generated_tokens"]) == ("GenerateStream", "OK", 5)

    stream = stub.GenerateStream(stream_req("Keep going", 250, request_id="cancel-5"), timeout=60)
    next(stream)
    stream.cancel()
    line = captured.access("cancel-5")
    assert line["code"] == "CANCELLED" and 1 <= line["generated_tokens"] < 250


def _error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_client_id_in_error_trailer_and_access_line(
    stub: pb_grpc.GenerationStub, captured: Captured, kind: str
) -> None:
    request_id = f"client-err-{kind}"
    request = text_req("Hi", 2, adapter_id="ghost", request_id=request_id)
    if kind == "unary":
        error = _error(lambda: stub.Generate(request, timeout=30))
    else:
        streamed = stream_req("Hi", 2, adapter_id="ghost", request_id=request_id)
        error = _error(lambda: list(stub.GenerateStream(streamed, timeout=30)))
    assert error.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert _metadata(error.trailing_metadata())["x-request-id"] == request_id  # type: ignore[attr-defined]
    line = captured.access(request_id)
    assert (line["code"], line["adapter"]) == ("NOT_FOUND", "ghost")
    assert line["method"] == ("Generate" if kind == "unary" else "GenerateStream")


def test_invalid_ids_are_never_echoed(stub: pb_grpc.GenerationStub, captured: Captured) -> None:
    """A request_id field that breaks the rules is refused by name; a bad header id is replaced. Either way the
    id in the trailers and logs is a fresh one, never the invalid text."""
    error = _error(lambda: stub.Generate(text_req("Hi", 2, request_id="has space"), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    fresh = _metadata(error.trailing_metadata())["x-request-id"]  # type: ignore[attr-defined]
    assert re.fullmatch(r"[0-9a-f]{32}", fresh)
    assert captured.access(fresh)["code"] == "INVALID_ARGUMENT"

    reply = stub.Generate(text_req("Hi", 2), metadata=(("x-request-id", "x" * 129),), timeout=30)
    assert re.fullmatch(r"[0-9a-f]{32}", reply.request_id)
    assert not [r for r in captured.lines() if "x" * 129 in json.dumps(r)]


def test_admin_calls_name_their_adapter(channel: grpc.Channel, captured: Captured) -> None:
    admin = apb_grpc.AdaptersStub(channel)
    error = _error(
        lambda: admin.GetAdapter(apb.GetAdapterRequest(id="nobody"), metadata=(("x-request-id", "adm-6"),), timeout=30)
    )
    assert _metadata(error.trailing_metadata())["x-request-id"] == "adm-6"  # type: ignore[attr-defined]
    line = captured.access("adm-6")
    assert (line["method"], line["adapter"], line["code"]) == ("GetAdapter", "nobody", "NOT_FOUND")


def test_every_line_of_a_request_names_it(channel: grpc.Channel, captured: Captured) -> None:
    """A warning logged inside a call (undecodable request bytes) carries the call's id, as its access line does."""
    raw = channel.unary_unary("/loraplex.v1.Generation/Generate")
    error = _error(lambda: raw(b"\xff\xff\xff", metadata=(("x-request-id", "bad-bytes-7"),), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    captured.access("bad-bytes-7")
    warnings = [r for r in captured.lines() if r["message"].startswith("event=malformed_request")]
    assert [w["request_id"] for w in warnings] == ["bad-bytes-7"]


def test_refused_by_auth_is_logged_with_its_id(
    tiny_server: Callable[..., BackgroundServer], captured: Captured
) -> None:
    """A refused request's bytes are never parsed, so its id comes from the ``x-request-id`` header."""
    srv = tiny_server(api_keys=("sekret",))
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        header = (("x-request-id", "no-key-8"),)
        error = _error(lambda: stub.Generate(text_req("Hi", 2, request_id="ignored"), metadata=header, timeout=30))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert _metadata(error.trailing_metadata())["x-request-id"] == "no-key-8"  # type: ignore[attr-defined]
    assert captured.access("no-key-8")["code"] == "UNAUTHENTICATED"


def test_http_peers_are_written_as_grpc_writes_them() -> None:
    from service.frontend.observer import peer_of

    assert (peer_of("10.0.0.7", 51234), peer_of("::1", 8)) == ("ipv4:10.0.0.7:51234", "ipv6:[::1]:8")


def test_log_settings_from_flags_and_environment() -> None:
    from service.cli import build_parser, serve_settings

    args = build_parser().parse_args(["serve", "--log-format", "json", "--log-level", "debug"])
    assert (serve_settings(args, env={}).log_format, serve_settings(args, env={}).log_level) == ("json", "DEBUG")
    from_env = Settings.from_env({"LORAPLEX_LOG_FORMAT": "json", "LORAPLEX_LOG_LEVEL": "WARNING"})
    assert (from_env.log_format, from_env.log_level) == ("json", "WARNING")
    with pytest.raises(ValueError, match="log_format"):
        Settings.from_env({"LORAPLEX_LOG_FORMAT": "xml"})


def test_text_lines_are_key_value() -> None:
    buffer = io.StringIO()
    logger = logging.getLogger("loraplex.test_text")
    handler = logs.handler("text", buffer)
    logger.addHandler(handler)
    token = logs.REQUEST_ID.set("txt-9")
    try:
        logger.warning("event=access", extra={"fields": {"method": "Generate", "adapter": "", "peer": "a b"}})
    finally:
        logs.REQUEST_ID.reset(token)
        logger.removeHandler(handler)
    line = buffer.getvalue().strip()
    assert re.fullmatch(
        r'ts=\S+Z level=WARNING logger=loraplex.test_text request_id=txt-9 event=access method=Generate adapter="" '
        r'peer="a b"',
        line,
    ), line


def test_engine_thread_lines_name_their_request(
    tiny_server: Callable[..., BackgroundServer], captured: Captured, served_tiny_dir: Path, tmp_path: Path
) -> None:
    """Lines the engine thread writes about a request (a row whose adapter overflows to inf/NaN logits, a row whose
    adapter fails to load) carry the client's id, over gRPC (one prompt, or two: the call's id on both rows'
    lines) and HTTP, in JSON and text."""
    boom = write_peft_adapter(tmp_path / "boom", served_tiny_dir, r=8, alpha=8, target_modules=("q_proj",), seed=2)
    # Finite weights (they pass every check when read) whose products overflow fp32 at run time.
    rewrite_adapter_tensors(boom, lambda t: {k: v.fill_(1e38) if "lora_B" in k else v for k, v in t.items()})
    torn = write_peft_adapter(tmp_path / "torn", served_tiny_dir, r=4, target_modules=("q_proj",), seed=3)
    text = io.StringIO()
    text_handler = logs.handler("text", text)
    logging.getLogger().addHandler(text_handler)
    try:
        srv = tiny_server(adapter_roots=(tmp_path,), http_port=0)
        with grpc.insecure_channel(srv.target) as channel:
            apb_grpc.AdaptersStub(channel).LoadAdapter(apb.LoadAdapterRequest(id="boom", source=str(boom)), timeout=60)
            stub = pb_grpc.GenerationStub(channel)
            error = _error(lambda: stub.Generate(text_req("Hi", 4, adapter_id="boom", request_id="nan-11"), timeout=60))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
            two = text_req("Hi", 4, adapter_id="boom")
            two.inputs.append(pb.Input(text="Hello there"))
            error = _error(lambda: stub.Generate(two, metadata=(("x-request-id", "nan-two-12"),), timeout=60))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
            apb_grpc.AdaptersStub(channel).LoadAdapter(apb.LoadAdapterRequest(id="torn", source=str(torn)), timeout=60)
            # Registered (headers indexed), then its weights turn NaN: the load the first request starts fails.
            rewrite_adapter_tensors(torn, lambda t: {k: v.fill_(math.nan) for k, v in t.items()})
            torn_request = text_req("Hi", 4, adapter_id="torn", request_id="torn-14")
            error = _error(lambda: stub.Generate(torn_request, timeout=60))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()  # type: ignore[attr-defined]
        body = {"model": "boom", "prompt": "Hi", "max_tokens": 4}
        reply = call(f"{base_url(srv)}/completions", body, headers={"x-request-id": "nan-http-13"})
        assert reply.status == 400 and reply.headers["x-request-id"] == "nan-http-13"
        for request_id in ("nan-11", "nan-two-12", "nan-http-13"):
            captured.access(request_id)
    finally:
        logging.getLogger().removeHandler(text_handler)
    lines = captured.lines()
    for event, level in (("non_finite_logits", "WARNING"), ("request_ended", "INFO")):
        about = [r for r in lines if r["message"].startswith(f"event={event} ") and "adapter=boom" in r["message"]]
        assert {r["level"] for r in about} == {level}
        ids = sorted(r["request_id"] for r in about)
        assert ids == ["nan-11", "nan-http-13", "nan-two-12", "nan-two-12"], (event, ids)
    (failed,) = [r for r in lines if r["message"].startswith("event=request_ended ") and "adapter=torn" in r["message"]]
    assert failed["request_id"] == "torn-14" and "error=NonFiniteTensor" in failed["message"]
    written = text.getvalue()
    assert re.search(r"level=WARNING logger=loraplex.engine request_id=nan-11 event=non_finite_logits ", written)
    assert re.search(r"request_id=nan-http-13 event=request_ended reason=error .*error=FailedPrecondition", written)


@pytest.mark.slow
def test_serve_writes_json_access_lines(served_tiny_dir: Path) -> None:
    """`loraplex serve --log-format json` (HTTP API on): every stderr line is one JSON object, the start-up
    announcement included; the gRPC and HTTP access lines carry their client's id."""
    command = [
        sys.executable, "-m", "service.cli", "serve", "--model", str(served_tiny_dir), "--port", "0",
        "--metrics-port", "-1", "--http-port", "0", "--log-format", "json", "--max-batch-size", "2", "--threads", "1",
    ]  # fmt: skip
    env = {**os.environ, "LORAPLEX_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        assert wait_until(lambda: any("event=serving" in line for line in lines), 120, poll=0.05), lines
        serving = next(json.loads(x) for x in lines if "event=serving" in x)
        target = re.search(r"grpc=(\S+)", serving["message"]).group(1)  # type: ignore[union-attr]
        url = re.search(r"http=(\S+)", serving["message"]).group(1)  # type: ignore[union-attr]
        with grpc.insecure_channel(target) as channel:
            pb_grpc.GenerationStub(channel).Generate(text_req("Hi", 3, request_id="subprocess-10"), timeout=60)
        body = {"model": served_tiny_dir.name, "prompt": "Hi", "max_tokens": 2}
        assert call(f"{url}/completions", body, headers={"x-request-id": "subprocess-http-11"}).status == 200
        assert wait_until(lambda: any("subprocess-http-11" in line for line in lines), 30, poll=0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        reader.join(5)
    records = [json.loads(line) for line in lines if line.strip()]  # every line: a JSON object
    assert all(isinstance(r, dict) and {"ts", "level", "logger", "request_id", "message"} <= set(r) for r in records)
    (access,) = [r for r in records if r["request_id"] == "subprocess-10"]
    assert access["logger"] == "loraplex.access" and access["code"] == "OK" and access["generated_tokens"] == 3
    (http,) = [r for r in records if r["request_id"] == "subprocess-http-11"]
    assert (http["method"], http["code"], http["generated_tokens"]) == ("http.completions", "OK", 2)
    assert set(http) == ACCESS_KEYS and re.fullmatch(r"ipv4:127\.0\.0\.1:\d+", http["peer"])
    assert any(r["message"] == "event=stopped" for r in records)


def test_python_warnings_and_thread_crashes_become_log_lines() -> None:
    """``logs.configure`` routes ``warnings.warn`` and a thread's uncaught exception into the log (a JSON log
    stays one object per line)."""
    root = logging.getLogger()
    handlers, level, buffer, hook = list(root.handlers), root.level, io.StringIO(), threading.excepthook

    def crash() -> None:
        raise RuntimeError("worker fell over")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            logs.configure("json", "INFO", buffer)
            warnings.warn("this knob is going away", FutureWarning, stacklevel=1)
        thread = threading.Thread(target=crash, name="doomed")
        thread.start()
        thread.join(10)
    finally:
        logging.captureWarnings(False)
        threading.excepthook = hook
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    warned, crashed = [json.loads(x) for x in buffer.getvalue().splitlines()]
    assert warned["logger"] == "py.warnings" and "this knob is going away" in warned["message"]
    assert (crashed["logger"], crashed["level"]) == ("loraplex.threads", "ERROR")
    assert crashed["message"] == "event=thread_crashed thread=doomed error=RuntimeError"
    assert "worker fell over" in crashed["exception"]
