"""The HTTP API's edge: capacity (429), serving state (503 while loading and draining), a client that goes away
(its generation is cancelled, its slot freed), TLS and mutual TLS with rotation, the listener's settings."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.certs import CA
from support.http_api import base_url, call, requests_count, sse_events
from support.servers import free_port, free_ports, in_flight, text_req, tiny_settings
from support.wait import wait_until

from service.api.http import errors
from service.api.server import BackgroundServer, start
from service.cli import build_parser, serve_settings
from service.config import ConfigError, Settings
from service.errors import (
    AdapterNotFound,
    InvalidRequest,
    LoraplexError,
    PermissionDenied,
    QueueFull,
    Unauthenticated,
    Unavailable,
)

LONG = {"max_new_tokens": 1000, "max_total_tokens": 1024}


def long_body(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "prompt": "occupy", "max_tokens": 1000, "ignore_eos": True, **extra}


def test_a_full_queue_is_429_with_retry_after(
    tiny_server: Callable[..., BackgroundServer], served_tiny_dir: Path
) -> None:
    srv = tiny_server(http_port=0, max_batch_size=1, max_queue=1, **LONG)
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        running = [stub.Generate.future(text_req("occupy", 1000), timeout=60) for _ in range(2)]
        assert wait_until(lambda: in_flight(srv) == 2, 30)  # one running, one waiting: the queue is full
        before = requests_count("http.completions", "RESOURCE_EXHAUSTED")
        for stream in (False, True):
            body = {"model": served_tiny_dir.name, "prompt": "one too many", "max_tokens": 2, "stream": stream}
            reply = call(f"{base_url(srv)}/completions", body)
            assert reply.status == 429, reply.body
            assert reply.headers["retry-after"] == "1"
            assert (reply.body["error"]["type"], reply.body["error"]["code"]) == ("rate_limit_error", "queue_full")
        assert requests_count("http.completions", "RESOURCE_EXHAUSTED") == before + 2
        for future in running:
            future.cancel()


def test_503_while_the_model_is_loading(tiny_server: Callable[..., BackgroundServer], served_tiny_dir: Path) -> None:
    srv = tiny_server(http_port=0, load=False)
    models = call(f"{base_url(srv)}/models")
    chat = call(f"{base_url(srv)}/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "hi"}]})
    for reply in (models, chat):
        assert reply.status == 503, reply.body
        assert reply.body["error"]["code"] == "unavailable" and "loading" in reply.body["error"]["message"]
        assert reply.headers["retry-after"] == "1"


def test_draining_refuses_new_work_with_503_and_lets_running_streams_finish(
    tiny_server: Callable[..., BackgroundServer], served_tiny_dir: Path
) -> None:
    srv = tiny_server(http_port=0, grace_seconds=60, **LONG)
    assert srv.server is not None
    url, model = base_url(srv), served_tiny_dir.name
    streamed: list[Any] = []
    reader = threading.Thread(
        target=lambda: streamed.append(call(f"{url}/completions", long_body(model, max_tokens=300, stream=True)))
    )
    with grpc.insecure_channel(srv.target) as channel:
        holder = pb_grpc.GenerationStub(channel).Generate.future(text_req("hold the drain", 1000), timeout=120)
        assert wait_until(lambda: in_flight(srv) == 1, 30)
        reader.start()
        assert wait_until(lambda: in_flight(srv) == 2, 30)
        drain = asyncio.run_coroutine_threadsafe(srv.server.drain(60), srv._loop)
        assert wait_until(lambda: srv.server is not None and srv.server.runtime.draining, 30)
        refused = call(f"{url}/completions", {"model": model, "prompt": "late", "max_tokens": 2})
        assert refused.status == 503 and "draining" in refused.body["error"]["message"]
        holder.cancel()
        reader.join(120)
        drain.result(120)
    srv.server = None  # drained and stopped: nothing left for the fixture's stop
    (reply,) = streamed
    events = sse_events(reply.body)
    assert reply.status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # the listener is closed after the drain
        call(f"{url}/models", timeout=5)


def _send(port: int, path: str, body: dict[str, object]) -> socket.socket:
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    sock.sendall(f"{head}content-length: {len(raw)}\r\n\r\n".encode() + raw)
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_client_that_goes_away_cancels_its_generation(
    tiny_server: Callable[..., BackgroundServer], served_tiny_dir: Path, stream: bool
) -> None:
    srv = tiny_server(http_port=0, **LONG)
    assert srv.server is not None and srv.server.http is not None
    method = "http.completions"
    before, finished = requests_count(method, "CANCELLED"), requests_count(method, "OK")
    sock = _send(srv.server.http.port, "/v1/completions", long_body(served_tiny_dir.name, stream=stream))
    assert wait_until(lambda: in_flight(srv) == 1, 30)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the headers and the first events are out
    sock.close()
    assert wait_until(lambda: in_flight(srv) == 0, 30), "the generation kept its slot after the client left"
    assert wait_until(lambda: requests_count(method, "CANCELLED") == before + 1, 30)
    assert requests_count(method, "OK") == finished  # it did not run to its end
    reply = call(f"{base_url(srv)}/completions", {"model": served_tiny_dir.name, "prompt": "next", "max_tokens": 2})
    assert reply.status == 200  # the server carries on


def _pki(folder: Path) -> dict[str, Any]:
    server_ca, client_ca = CA("server ca"), CA("client ca")
    return {
        "server_ca": server_ca.write(folder / "server-ca.crt"),
        "client_ca": client_ca.write(folder / "client-ca.crt"),
        "server": server_ca.issue(folder / "live", "server", server=True),
        "client": client_ca.issue(folder, "client", server=False),
    }


def _tls_context(ca: Path, client: Any = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return context


def test_https_with_the_grpc_tls_files_and_rotation(
    tiny_server: Callable[..., BackgroundServer], tmp_path: Path, served_tiny_dir: Path
) -> None:
    pki = _pki(tmp_path)
    srv = tiny_server(http_port=0, tls_cert=pki["server"].cert, tls_key=pki["server"].key)
    url = base_url(srv, "https")
    reply = call(f"{url}/models", context=_tls_context(pki["server_ca"]))
    assert reply.status == 200 and reply.body["data"][0]["id"] == served_tiny_dir.name
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext to the TLS port
        call(base_url(srv) + "/models", timeout=10)
    new_ca = CA("new ca")
    fresh = new_ca.issue(tmp_path / "fresh", "server", server=True)
    os.replace(fresh.key, pki["server"].key)  # as a Secret update swaps the files
    os.replace(fresh.cert, pki["server"].cert)
    rotated = call(f"{url}/models", context=_tls_context(new_ca.write(tmp_path / "new-ca.crt")))
    assert rotated.status == 200
    with pytest.raises(urllib.error.URLError):  # the old certificate is no longer served
        call(f"{url}/models", context=_tls_context(pki["server_ca"]), timeout=10)


def test_mutual_tls_needs_a_client_certificate(
    tiny_server: Callable[..., BackgroundServer], tmp_path: Path, served_tiny_dir: Path
) -> None:
    pki = _pki(tmp_path)
    srv = tiny_server(
        http_port=0, tls_cert=pki["server"].cert, tls_key=pki["server"].key, tls_client_ca=pki["client_ca"]
    )
    url = base_url(srv, "https")
    assert call(f"{url}/models", context=_tls_context(pki["server_ca"], pki["client"])).status == 200
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
        call(f"{url}/models", context=_tls_context(pki["server_ca"]), timeout=10)


def test_the_listener_is_off_with_minus_one_and_a_taken_port_fails_start_up(served_tiny_dir: Path) -> None:
    with BackgroundServer(tiny_settings(served_tiny_dir, http_port=-1), load=False) as srv:
        assert srv.server is not None and srv.server.http is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        loop = asyncio.new_event_loop()
        try:
            with pytest.raises(OSError, match=f"HTTP API to 127.0.0.1:{port}"):
                loop.run_until_complete(start(tiny_settings(served_tiny_dir, http_port=port)))
        finally:
            loop.close()


def test_http_port_setting_flag_and_variable() -> None:
    assert Settings().http_port == 8000 and Settings().host == "127.0.0.1"
    assert Settings.from_env({"LORAPLEX_HTTP_PORT": "-1"}).http_port == -1
    port = free_port()
    assert serve_settings(build_parser().parse_args(["serve", "--http-port", str(port)]), {}).http_port == port
    with pytest.raises(ConfigError, match="http_port"):
        Settings.from_env({}, http_port=-2)


def test_request_bounds_hold_before_any_work(
    tiny_server: Callable[..., BackgroundServer], served_tiny_dir: Path
) -> None:
    srv = tiny_server(http_port=0, max_message_bytes=64 << 10, max_prompt_bytes=1000)
    url, model = base_url(srv), served_tiny_dir.name
    big = call(f"{url}/completions", {"model": model, "prompt": "x" * (100 << 10), "max_tokens": 2})
    assert big.status == 400 and "--max-message-bytes" in big.body["error"]["message"], big.body
    long = call(f"{url}/completions", {"model": model, "prompt": "x" * 2000, "max_tokens": 2})
    assert long.status == 400 and long.body["error"]["param"] == "prompt", long.body
    assert "--max-prompt-bytes" in long.body["error"]["message"]
    turns = [{"role": "user", "content": "y" * 600}] * 2
    chat = call(f"{url}/chat/completions", {"model": model, "messages": turns, "max_tokens": 2})
    assert chat.status == 400 and chat.body["error"]["param"] == "messages", chat.body


def test_a_body_that_is_not_a_json_object_is_400(
    tiny_server: Callable[..., BackgroundServer], served_tiny_dir: Path
) -> None:
    srv = tiny_server(http_port=0)
    for body, words in ((b'{"model": ', "not valid JSON"), ([1, 2], "must be a JSON object")):
        reply = call(f"{base_url(srv)}/completions", body)
        assert reply.status == 400 and reply.body["error"]["type"] == "invalid_request_error", reply.body
        assert words in reply.body["error"]["message"], reply.body


def _error_classes(cls: type[LoraplexError] = LoraplexError) -> list[type[LoraplexError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _error_classes(sub))]


def test_every_error_class_has_its_http_status_and_openai_shape() -> None:
    """A new error class (or status) cannot fall through to 500: every status of the tree has an HTTP code."""
    for cls in _error_classes():
        assert cls.status in errors.HTTP_STATUS, cls
    cases = {
        Unauthenticated("no key"): (401, "authentication_error", "unauthenticated"),
        PermissionDenied("admin only"): (403, "permission_error", "permission_denied"),
        AdapterNotFound("ghost"): (404, "invalid_request_error", "model_not_found"),
        QueueFull("full"): (429, "rate_limit_error", "queue_full"),
        Unavailable("draining"): (503, "server_error", "unavailable"),
        InvalidRequest("bad top_p", field="sampling.top_p"): (400, "invalid_request_error", "invalid_request"),
    }
    for exc, (status, kind, code) in cases.items():
        error = errors.error_body(exc, chat=True)["error"]
        assert (errors.http_status(exc), error["type"], error["code"]) == (status, kind, code), exc
        assert set(error) == {"message", "type", "param", "code"}
    assert errors.error_body(InvalidRequest("x", field="sampling.top_p"), chat=True)["error"]["param"] == "top_p"
    assert errors.param_of("inputs[1].text", chat=False) == "prompt"
    assert errors.param_of("input.messages", chat=True) == "messages"
    bug = errors.error_body(KeyError("secret"), chat=True)["error"]
    assert errors.http_status(KeyError("x")) == 500 and "secret" not in bug["message"] and bug["code"] == "internal"


def test_a_serve_process_with_the_http_api_drains_on_sigterm(served_tiny_dir: Path) -> None:
    """A real `loraplex serve` with the HTTP API: on SIGTERM the HTTP listener stays up through the drain,
    answering 503, and the process exits 0 once the running request is done."""
    grpc_port, http_port = free_ports(2)
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(served_tiny_dir), "--port", str(grpc_port)]
    cmd += ["--http-port", str(http_port), "--metrics-port", "-1", "--grace-seconds", "60"]
    cmd += ["--max-total-tokens", "1024", "--max-prompt-tokens", "256"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, model = f"http://127.0.0.1:{http_port}/v1", served_tiny_dir.name
    try:

        def serving() -> bool:
            try:
                return call(f"{url}/models", timeout=2).status == 200
            except (urllib.error.URLError, ConnectionError):
                return False

        if not wait_until(lambda: serving() or proc.poll() is not None, 120) or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"the HTTP API never answered 200: {proc.communicate(timeout=10)[0][-2000:]}")
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            holder = pb_grpc.GenerationStub(channel).Generate.future(text_req("hold the drain", 1000), timeout=120)
            time.sleep(0.5)  # the request is running (or queued): the drain waits for it
            proc.send_signal(signal.SIGTERM)

            def draining() -> bool:
                reply = call(f"{url}/completions", {"model": model, "prompt": "late", "max_tokens": 2}, timeout=5)
                return reply.status == 503 and "draining" in reply.body["error"]["message"]

            assert wait_until(draining, 30)
            holder.cancel()
        output, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, output[-2000:]
        assert "event=stopped" in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
