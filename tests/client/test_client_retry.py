"""The client against real servers over loopback: gRPC-native retries of refused calls (queue full), the off
switch, ``wait_for_ready`` for a server started late, ``stream()`` as a context manager that cancels on the
server, the request id on errors, and the CLI's ``LORAPLEX_TARGET`` / ``LORAPLEX_API_KEY``."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import loraplex
import pytest
from loraplex import _channel, _retry
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.metrics import requests_total
from support.servers import in_flight, stream_req, tiny_settings
from support.wait import wait_until

from service.api.server import BackgroundServer

# Backoffs long enough that no retry can run out before the test frees capacity, short enough to stay quick.
PATIENT = loraplex.RetryPolicy(max_attempts=5, initial_backoff=0.5, max_backoff=2.0, backoff_multiplier=2.0)
# For a wait as long as a model load on a busy machine: the four randomized backoffs add up to ~11 s on average.
VERY_PATIENT = loraplex.RetryPolicy(max_attempts=5, initial_backoff=2.0, max_backoff=8.0, backoff_multiplier=2.0)


def test_retry_policy_is_a_service_config_for_idempotent_methods() -> None:
    config = json.loads(_retry.service_config(loraplex.RetryPolicy()) or "")
    (method,) = config["methodConfig"]
    assert method["retryPolicy"] == {
        "maxAttempts": 4, "initialBackoff": "0.2s", "maxBackoff": "5s", "backoffMultiplier": 2.0,
        "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
    }  # fmt: skip
    names = method["name"]
    assert {"service": "loraplex.v1.Generation"} in names
    assert not [n for n in names if n.get("method") in ("LoadAdapter", "UnloadAdapter")]
    assert _retry.service_config(None) is None
    options = dict(_channel.channel_options(None, [], _retry.service_config(PATIENT)))
    assert json.loads(options["grpc.service_config"])["methodConfig"][0]["retryPolicy"]["maxAttempts"] == 5
    own = dict(_channel.channel_options(None, [("grpc.service_config", "{}")], _retry.service_config(PATIENT)))
    assert own["grpc.service_config"] == "{}"  # the caller's own service config wins
    for bad in ({"max_attempts": 1}, {"max_attempts": 6}, {"initial_backoff": 0}, {"codes": ("NOPE",)}):
        with pytest.raises(ValueError):
            loraplex.RetryPolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        loraplex.Client("127.0.0.1:1", retry=3)  # type: ignore[arg-type]


LONG = 7000  # tokens of a blocking stream: tens of seconds, however fast the machine


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory, served_tiny_dir: Path) -> Path:
    """``served_tiny_dir``'s tiny model with room for ``LONG``-token streams (8192 positions)."""
    from support.tiny_models import write_served_tiny

    return write_served_tiny(tmp_path_factory.mktemp("long_tiny"), served_tiny_dir, max_position_embeddings=8192)


@pytest.fixture
def full_server(
    tiny_server: Callable[..., BackgroundServer], long_model_dir: Path
) -> Iterator[tuple[BackgroundServer, Callable[[], None]]]:
    """A server with room for 2 requests (1 running, 1 waiting) and ``fill()``, which takes both with streams
    that outlast any test (cancelled at teardown, or earlier by the test through ``fill.release``)."""
    srv = tiny_server(
        model=long_model_dir, max_batch_size=1, max_queue=1, metrics_port=0, max_new_tokens=LONG,
        max_total_tokens=LONG + 200,
    )  # fmt: skip
    channel = grpc.insecure_channel(srv.target)
    stub = pb_grpc.GenerationStub(channel)
    calls: list[Any] = []

    def fill() -> None:
        # One at a time: sent together, the second could reach the engine first and run, and calls[0] would then
        # wait in the queue for a whole LONG stream before its first token (a CI failure).
        calls.append(stub.GenerateStream(stream_req("Keep busy", LONG), timeout=120))
        next(calls[0])  # running
        calls.append(stub.GenerateStream(stream_req("Keep busy", LONG), timeout=120))
        assert wait_until(lambda: in_flight(srv) == 2, 30)  # waiting

    def release() -> None:
        for call in calls:
            call.cancel()

    fill.release = release  # type: ignore[attr-defined]
    try:
        yield srv, fill
    finally:
        release()
        channel.close()


def test_queue_full_is_retried_until_room_frees(full_server: tuple[BackgroundServer, Callable[[], None]]) -> None:
    srv, fill = full_server
    fill()
    before = requests_total(srv, "Generate", "RESOURCE_EXHAUSTED")
    # Off switch first: one attempt, refused.
    with loraplex.Client(srv.target, timeout=30, retry=None) as plain, pytest.raises(loraplex.ResourceExhausted):
        plain.generate("Hi", max_new_tokens=2)
    assert requests_total(srv, "Generate", "RESOURCE_EXHAUSTED") == before + 1

    results: list[Any] = []
    with loraplex.Client(srv.target, timeout=60, retry=PATIENT) as client:
        worker = threading.Thread(target=lambda: results.append(client.generate("Hi", max_new_tokens=2)))
        worker.start()
        # The first attempt is refused, then gRPC backs off and tries again; free the room meanwhile.
        assert wait_until(lambda: requests_total(srv, "Generate", "RESOURCE_EXHAUSTED") >= before + 2, 30)
        fill.release()  # type: ignore[attr-defined]
        worker.join(60)
    (result,) = results
    assert result.usage.generated_tokens == 2
    assert requests_total(srv, "Generate", "OK") >= 1


def test_unavailable_while_loading_is_retried(tiny_server: Callable[..., BackgroundServer]) -> None:
    srv = tiny_server(load=False, metrics_port=0)
    results: list[Any] = []
    with loraplex.Client(srv.target, timeout=60, retry=VERY_PATIENT) as client:
        worker = threading.Thread(target=lambda: results.append(client.generate("Hi", max_new_tokens=2)))
        worker.start()
        assert wait_until(lambda: requests_total(srv, "Generate", "UNAVAILABLE") >= 1, 30)  # "still loading"
        assert srv.server is not None
        srv.call(srv.server.load())
        worker.join(60)
    (result,) = results
    assert result.usage.generated_tokens == 2


def test_wait_for_ready_reaches_a_server_started_late(served_tiny_dir: Any, free_port: int) -> None:
    settings = tiny_settings(served_tiny_dir, port=free_port)
    target = f"127.0.0.1:{free_port}"
    with loraplex.Client(target, timeout=5, retry=None) as eager, pytest.raises(loraplex.Unavailable):
        eager.generate("Hi", max_new_tokens=2)  # nothing listens yet: fails at once

    with ExitStack() as stack:
        started = threading.Timer(1.0, lambda: stack.enter_context(BackgroundServer(settings)))
        started.start()
        with loraplex.Client(target, timeout=90, wait_for_ready=True) as client:
            begun = time.monotonic()
            result = client.generate("Hi", max_new_tokens=2)
            waited = time.monotonic() - begun
        started.join(60)
    assert result.usage.generated_tokens == 2 and waited >= 0.9


def test_stream_context_manager_cancels_on_the_server(full_server: tuple[BackgroundServer, Callable[[], None]]) -> None:
    srv, _ = full_server
    before = requests_total(srv, "GenerateStream", "CANCELLED")
    with loraplex.Client(srv.target, timeout=60) as client:
        with client.stream("Tell me everything", max_new_tokens=LONG, ignore_eos=True) as deltas:
            first = next(deltas)
            assert first.text is not None and in_flight(srv) == 1
        assert wait_until(lambda: in_flight(srv) == 0, 30)  # the slot is free again
        assert list(deltas) == []  # closed: iteration ends at once
    assert wait_until(lambda: requests_total(srv, "GenerateStream", "CANCELLED") == before + 1, 30)

    async def run() -> None:
        client = loraplex.AsyncClient(srv.target, timeout=60)
        async with client, client.stream("And again", max_new_tokens=LONG, ignore_eos=True) as deltas:
            await deltas.__anext__()
            assert in_flight(srv) == 1

    asyncio.run(run())
    assert wait_until(lambda: in_flight(srv) == 0, 30)
    assert wait_until(lambda: requests_total(srv, "GenerateStream", "CANCELLED") == before + 2, 30)


def test_errors_carry_the_request_id(server: BackgroundServer) -> None:
    with loraplex.Client(server.target, timeout=30) as client, pytest.raises(loraplex.NotFound) as err:
        client.generate("Hi", adapter="ghost", request_id="mine-1")
    assert err.value.request_id == "mine-1"


def test_cli_reads_target_and_api_key_from_the_environment(
    tiny_server: Callable[..., BackgroundServer], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    srv = tiny_server(api_keys=("cli-key",))
    monkeypatch.setenv("LORAPLEX_TARGET", srv.target)
    monkeypatch.delenv("LORAPLEX_API_KEY", raising=False)
    assert main(["info"]) == 1  # reached the server (from LORAPLEX_TARGET), refused without a key
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("LORAPLEX_API_KEY", "cli-key")
    assert main(["info"]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 49152
    assert main(["generate", "--adapter", "ghost", "Hi"]) == 1  # a failed call names its request id
    err = capsys.readouterr().err
    assert "NOT_FOUND" in err and re.search(r"\(request_id=[0-9a-f]{32}\)", err), err
