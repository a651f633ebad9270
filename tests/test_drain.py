"""Graceful drain of a real `loraplex serve` process: SIGTERM -> NOT_SERVING -> UNAVAILABLE for new work -> running
streams finish -> exit 0 within the grace period."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc

GRACE = 30.0
NEW_TOKENS = 300


def health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service="loraplex.v1.Generation"), timeout=2).status)


@pytest.fixture
def serving(served_tiny_dir: Path, free_port: int) -> tuple[subprocess.Popen[str], str]:
    port = free_port
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(served_tiny_dir), "--port", str(port)]
    cmd += ["--metrics-port", "-1", "--http-port", "-1", "--grace-seconds", str(GRACE), "--max-total-tokens", "1024"]
    cmd += ["--max-prompt-tokens", "256", "--max-batch-size", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    target = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    with grpc.insecure_channel(target) as channel:
        while time.monotonic() < deadline:
            try:
                if health(channel) == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                time.sleep(0.05)
        else:
            proc.kill()
            pytest.fail(f"server did not become SERVING: {proc.communicate()[0][-2000:]}")
    yield proc, target
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_sigterm_drains_running_streams_and_exits_zero(serving: tuple[subprocess.Popen[str], str]) -> None:
    proc, target = serving
    results: list[tuple[int, int]] = []
    started = threading.Barrier(4)

    def stream(i: int) -> None:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            req = pb.GenerateStreamRequest(
                input=pb.Input(text=f"stream {i}"),
                stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                return_options=pb.ReturnOptions(return_token_ids=True),
            )
            tokens, finish = 0, 0
            for n, msg in enumerate(stub.GenerateStream(req, timeout=120)):
                if n == 0:
                    started.wait(30)
                tokens += len(msg.token_ids)
                finish = msg.finish_reason
            results.append((tokens, finish))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(60)  # every stream has its first token: all three are running
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)

    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        saw_not_serving = saw_unavailable = False
        while time.monotonic() - sent < 5 and not (saw_not_serving and saw_unavailable):
            try:
                saw_not_serving |= health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
                stub.Generate(pb.GenerateRequest(inputs=[pb.Input(text="new work")]), timeout=5)
            except grpc.RpcError as exc:
                saw_unavailable |= exc.code() == grpc.StatusCode.UNAVAILABLE
            time.sleep(0.02)
    for t in threads:
        t.join(GRACE + 10)
    rc = proc.wait(GRACE + 10)
    elapsed = time.monotonic() - sent
    output = proc.stdout.read() if proc.stdout else ""

    assert saw_not_serving, "health must turn NOT_SERVING on SIGTERM"
    assert saw_unavailable, "new requests must get UNAVAILABLE while draining"
    assert sorted(results) == [(NEW_TOKENS, pb.FINISH_REASON_LENGTH)] * 3, "a running stream was lost or cut"
    assert rc == 0, output[-2000:]
    assert elapsed < GRACE, f"drain took {elapsed:.1f} s, over the {GRACE} s grace period"
    assert "event=draining" in output and "event=stopped" in output
