"""Shared test helpers for live servers: the test settings builder, request builders and free ports.

Test modules import these (tests never import each other); `conftest.py` wraps the server ones in fixtures.
Nothing here starts work at import time.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from loraplex.v1 import generation_pb2 as pb

from service.config import Settings

if TYPE_CHECKING:
    from service.api.server import BackgroundServer

# Small limits so bounds are cheap to reach; a test overrides what it needs.
TEST_SETTINGS: dict[str, object] = {
    "port": 0,
    "metrics_port": -1,
    "http_port": -1,  # a test that drives the HTTP API asks for port 0
    "dtype": "float32",  # exactness tests compare with fp32 references; the server default is "auto"
    "max_batch_size": 8,
    "max_queue": 4,
    "max_prompt_tokens": 128,
    "max_new_tokens": 256,
    "max_total_tokens": 512,
}


def tiny_settings(folder: Path, *defaults: Mapping[str, object], **overrides: object) -> Settings:
    """Settings for a test server on loopback over the model in ``folder``: `TEST_SETTINGS`, then each of
    ``defaults`` (a test module's own, in order), then ``overrides``."""
    values: dict[str, object] = {"model": folder, **TEST_SETTINGS}
    for layer in defaults:
        values.update(layer)
    return Settings(**{**values, **overrides})  # type: ignore[arg-type]


def text_req(text: str, n: int = 16, **kw: object) -> pb.GenerateRequest:
    """One greedy text input, exactly ``n`` new tokens (EOS ignored), token ids returned."""
    return pb.GenerateRequest(
        inputs=[pb.Input(text=text)],
        stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True),
        return_options=pb.ReturnOptions(return_token_ids=True),
        **kw,  # type: ignore[arg-type]
    )


def stream_req(text: str, n: int = 16, **kw: object) -> pb.GenerateStreamRequest:
    """The streaming twin of `text_req`."""
    return pb.GenerateStreamRequest(
        input=pb.Input(text=text),
        stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True),
        return_options=pb.ReturnOptions(return_token_ids=True),
        **kw,  # type: ignore[arg-type]
    )


def as_stream(r: pb.GenerateRequest) -> pb.GenerateStreamRequest:
    """The same request for GenerateStream: its first input (or an empty one), adapter, sampling, stopping, id,
    speculate, constraint."""
    stream = pb.GenerateStreamRequest(
        input=r.inputs[0] if r.inputs else pb.Input(),
        adapter_id=r.adapter_id,
        sampling=r.sampling,
        stopping=r.stopping,
        request_id=r.request_id,
    )
    if r.HasField("speculate"):
        stream.speculate = r.speculate
    if r.HasField("constraint"):
        stream.constraint.CopyFrom(r.constraint)
    return stream


def in_flight(srv: BackgroundServer) -> int:
    """Requests the started server's engine holds now (running and waiting)."""
    assert srv.server is not None and srv.server.runtime.loaded is not None
    return srv.server.runtime.loaded.engine.in_flight


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    """One free loopback port."""
    return free_ports(1)[0]


Outcome = tuple[grpc.StatusCode, str]


def outcome(call: Callable[[], object]) -> Outcome:
    """The status code and details ``call`` ends with (OK and "" when it returns)."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""
