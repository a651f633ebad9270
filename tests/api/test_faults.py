"""Fault injection against a live server over loopback gRPC: an engine step that raises, a model that cannot be
loaded, a client that goes away mid-stream and a deadline that passes mid-generation.

Each test checks what the fault does to the requests it hits (their status) and what it must not do to the rest
(the engine keeps serving; a later request gets the same tokens as before the fault; the slot is reused).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.metrics import sample
from support.paths import ROOT
from support.servers import stream_req
from support.wait import wait_until

from service.api.server import BackgroundServer
from service.engine.engine import Engine


def engine_of(server: BackgroundServer) -> Engine:
    assert server.server is not None and server.server.runtime.loaded is not None
    return server.server.runtime.loaded.engine


def tokens_of(stub: pb_grpc.GenerationStub, text: str, n: int) -> list[int]:
    return [t for c in stub.GenerateStream(stream_req(text, n), timeout=60) for t in c.token_ids]


def tokens_together(stub: pb_grpc.GenerationStub, prompts: tuple[str, ...], n: int) -> dict[str, list[int]]:
    """One Generate call with every prompt: they are submitted together and share batches."""
    request = pb.GenerateRequest(
        inputs=[pb.Input(text=p) for p in prompts],
        stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True),
        return_options=pb.ReturnOptions(return_token_ids=True),
    )
    results = stub.Generate(request, timeout=60).results
    return {p: list(r.token_ids) for p, r in zip(prompts, results, strict=True)}


def _drain(call: Any) -> list[pb.GenerateStreamResponse]:
    """What a cancelled stream still delivered before its CANCELLED status."""
    got: list[pb.GenerateStreamResponse] = []
    with pytest.raises(grpc.RpcError) as err:
        got.extend(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    return got


class FailingForward:
    """Wraps the model's forward; after ``arm()`` the next call runs, fills the K/V it could have written (its slots,
    positions up to its last) with NaN, and raises: a step that went wrong half-way, at its worst."""

    def __init__(self, model: Any) -> None:
        self.original = model.forward
        self.armed = threading.Event()
        self.raised = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.original(*args, **kwargs)
        if self.armed.is_set():
            self.armed.clear()
            self.raised += 1
            tokens, positions, cache, slot_start = args[:4]
            rows = slice(slot_start, slot_start + tokens.shape[0])
            cache.data[:, :, rows, :, : int(positions.max()) + 1] = float("nan")  # [L, 2, B, n_kv, T, D]
            raise RuntimeError("injected fault in the model forward")
        return out


def test_a_failing_step_fails_only_its_rows_and_the_engine_goes_on(
    server: BackgroundServer, stub: pb_grpc.GenerationStub
) -> None:
    engine = engine_of(server)
    prompts = ("Hello", "Something else entirely, and a longer prompt than the first")
    before = tokens_together(stub, prompts, 64)
    failures = sample("loraplex_engine_step_failures_total")

    fault = FailingForward(engine.model)
    engine.model.forward = fault  # type: ignore[method-assign]
    try:
        streams = [stub.GenerateStream(stream_req(p, 200), timeout=60) for p in prompts]
        for s in streams:
            next(s)
        assert wait_until(lambda: engine.state().running == 2)
        fault.armed.set()
        for s in streams:
            with pytest.raises(grpc.RpcError) as err:
                list(s)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "engine step" in (err.value.details() or "") and "retry" in (err.value.details() or "")
        assert fault.raised == 1
        assert wait_until(lambda: engine.in_flight == 0 and engine.state().running == 0)
        # The engine goes on, and the NaN the failed step left in the slots did not survive it: rows of different
        # lengths sharing a batch read (masked) positions past their own length, where a NaN would spread.
        after = tokens_together(stub, prompts, 64)
        assert after == before
    finally:
        engine.model.forward = fault.original  # type: ignore[method-assign]
    assert sample("loraplex_engine_step_failures_total") == failures + 1
    assert engine.alive


def test_waiting_requests_survive_a_failing_step(tiny_server: Callable[..., BackgroundServer]) -> None:
    srv = tiny_server(max_batch_size=1, max_queue=2)
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        engine = engine_of(srv)
        expected = tokens_of(stub, "queued behind", 16)
        fault = FailingForward(engine.model)
        engine.model.forward = fault  # type: ignore[method-assign]
        running = stub.GenerateStream(stream_req("running", 200), timeout=60)
        next(running)
        queued = stub.GenerateStream(stream_req("queued behind", 16), timeout=60)
        assert wait_until(lambda: engine.state().waiting == 1)
        fault.armed.set()
        with pytest.raises(grpc.RpcError) as err:
            list(running)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert [t for c in queued for t in c.token_ids] == expected  # not in the failed step: served normally


@pytest.mark.parametrize("damage", ["truncated", "corrupt-header", "directory"])
def test_a_model_that_cannot_be_read_never_serves_and_exits_non_zero(
    served_tiny_dir: Path, tmp_path: Path, damage: str
) -> None:
    broken = tmp_path / "model"
    shutil.copytree(served_tiny_dir, broken)
    weights = broken / "model.safetensors"
    raw = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(raw[: len(raw) // 2])
    elif damage == "corrupt-header":
        weights.write_bytes(raw[:8] + b"[" + raw[9:])
    else:
        weights.unlink()
        weights.mkdir()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(broken), "--port", "0", "--metrics-port", "-1"]
    cmd += ["--http-port", "-1"]
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'clients' / 'python'}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    statuses: list[int] = []
    assert proc.stderr is not None
    for line in proc.stderr:  # ends when the process closes stderr (exits)
        lines.append(line)
        port = re.search(r"event=listening grpc=127\.0\.0\.1:(\d+)", line)
        if port:
            with grpc.insecure_channel(f"127.0.0.1:{port[1]}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                with contextlib.suppress(grpc.RpcError):  # already gone
                    statuses.append(health.Check(health_pb2.HealthCheckRequest(), timeout=5).status)
    code = proc.wait(timeout=120)
    log = "".join(lines)
    assert code != 0, log
    assert health_pb2.HealthCheckResponse.SERVING not in statuses
    failed = [line for line in lines if "event=load_failed" in line]
    assert len(failed) == 1 and str(broken) in failed[0], log  # names the model folder or its file
    assert "Traceback" not in log  # one clear line, not a stack


LONG = {"max_batch_size": 1, "max_queue": 1, "max_new_tokens": 1000, "max_total_tokens": 1024}


def test_a_client_that_goes_away_frees_its_slot_for_the_next_request(
    tiny_server: Callable[..., BackgroundServer],
) -> None:
    srv = tiny_server(**LONG)
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        engine = engine_of(srv)
        expected = tokens_of(stub, "next in line", 12)
        cancelled = sample("loraplex_requests_total", method="GenerateStream", code="CANCELLED")
        call = stub.GenerateStream(stream_req("a long one", 1000), timeout=60)
        got = len(next(call).token_ids)
        call.cancel()
        assert got + sum(len(c.token_ids) for c in _drain(call)) < 1000  # cut mid-generation
        assert wait_until(lambda: engine.in_flight == 0 and engine.state().running == 0)
        # The one slot is free again: the next request runs (and gives its normal answer).
        assert tokens_of(stub, "next in line", 12) == expected
        assert wait_until(
            lambda: sample("loraplex_requests_total", method="GenerateStream", code="CANCELLED") > cancelled
        )
        assert sample("loraplex_requests_total", method="GenerateStream", code="CANCELLED") == cancelled + 1


def test_a_deadline_mid_generation_frees_its_slot_and_is_counted(tiny_server: Callable[..., BackgroundServer]) -> None:
    srv = tiny_server(**LONG)
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        engine = engine_of(srv)
        expected = tokens_of(stub, "next in line", 12)

        def timed_out() -> float:  # the edge counts a client deadline as CANCELLED today, DEADLINE_EXCEEDED later
            return sum(
                sample("loraplex_requests_total", method="GenerateStream", code=code)
                for code in ("CANCELLED", "DEADLINE_EXCEEDED")
            )

        # Mid-generation: some tokens arrived, not all. On a busy machine a short deadline can pass before the
        # server even starts the call (then nothing is counted), so the deadline grows until tokens arrive.
        for deadline in (0.5, 1.0, 2.0, 4.0):
            counted = timed_out()
            call = stub.GenerateStream(stream_req("a long one", 1000), timeout=deadline)
            got: list[pb.GenerateStreamResponse] = []
            with pytest.raises(grpc.RpcError) as err:
                got.extend(call)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if got:
                break
        assert 0 < sum(len(c.token_ids) for c in got) < 1000
        assert wait_until(lambda: engine.in_flight == 0 and engine.state().running == 0)
        assert tokens_of(stub, "next in line", 12) == expected
        assert wait_until(lambda: timed_out() > counted)
        assert timed_out() == counted + 1


def test_a_prompt_that_tokenizes_to_nothing_is_invalid_argument(stub: pb_grpc.GenerationStub) -> None:
    # Found by the long fuzz run of request conversion: "\x16" is valid text with no token; the engine refuses it.
    with pytest.raises(grpc.RpcError) as err:
        list(stub.GenerateStream(stream_req("\x16", 4), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "empty" in (err.value.details() or "")
