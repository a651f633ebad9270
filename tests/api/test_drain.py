"""Stop signals to a real `loraplex serve` process, at every stage: during the drain (SIGTERM -> NOT_SERVING ->
UNAVAILABLE for new work -> running streams finish, or are cut with UNAVAILABLE at the grace's end -> exit 0), while
the model loads, and before the event loop runs (imports, settings). Every way out is exit 0 with an
``event=stopped`` line; timing is checked through the server's own drain outcome, never a wall clock here."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

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
    cmd += ["--max-prompt-tokens", "256", "--max-batch-size", "8", "--dtype", "float32"]
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
    output = proc.stdout.read() if proc.stdout else ""

    assert saw_not_serving, "health must turn NOT_SERVING on SIGTERM"
    assert saw_unavailable, "new requests must get UNAVAILABLE while draining"
    assert sorted(results) == [(NEW_TOKENS, pb.FINISH_REASON_LENGTH)] * 3, "a running stream was lost or cut"
    assert rc == 0, output[-2000:]
    assert "event=draining signal=SIGTERM" in output
    assert stopped_fields(output) == {"signal": "SIGTERM", "cut": "0", "within_grace": "True"}, output[-2000:]


def stopped_fields(output: str) -> dict[str, str]:
    """The fields of the server's ``event=stopped`` line that say what its drain did."""
    line = next(x for x in output.splitlines() if "event=stopped" in x)
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    return {k: fields[k] for k in ("signal", "cut", "within_grace") if k in fields}


def test_a_stream_still_running_at_the_grace_end_is_cut_and_the_drain_keeps_its_bound(
    served_tiny_dir: Path, free_port: int
) -> None:
    grace = 1.0
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(served_tiny_dir), "--port", str(free_port)]
    cmd += ["--metrics-port", "0", "--http-port", "0", "--grace-seconds", str(grace), "--max-total-tokens", "8192"]
    cmd += ["--max-new-tokens", "8000", "--max-prompt-tokens", "256", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    target = f"127.0.0.1:{free_port}"
    try:
        _wait_serving(proc, target)
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            req = pb.GenerateStreamRequest(
                input=pb.Input(text="a stream longer than the grace"),
                stopping=pb.StoppingCriteria(max_new_tokens=8000, ignore_eos=True),
                return_options=pb.ReturnOptions(return_token_ids=True),
            )
            stream = stub.GenerateStream(req, timeout=120)
            tokens = len(next(stream).token_ids)  # running
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as cut:
                for message in stream:
                    tokens += len(message.token_ids)
        rc = proc.wait(60)
        output = proc.stdout.read() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value
    assert "shutting down" in (cut.value.details() or "")
    assert 0 < tokens < 8000
    assert rc == 0, output[-2000:]
    assert "event=drain_grace_ended grace_seconds=1.0 cut=1" in output, output[-2000:]
    # The server's own record: one stream cut, and SIGTERM to everything closed within the grace + 0.5 s.
    assert stopped_fields(output) == {"signal": "SIGTERM", "cut": "1", "within_grace": "True"}, output[-2000:]


def _wait_serving(proc: subprocess.Popen[str], target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        for _ in range(2400):
            try:
                if health(channel) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    pytest.fail(f"server did not become SERVING: {proc.communicate()[0][-2000:]}")


# `loraplex serve` with one start-up stage held open, so a signal reaches it there for certain: the stage prints a
# marker, then waits (the real stages are short; which one a signal meets is otherwise a matter of luck).
HELD_STAGE = """
import importlib.abc, sys, threading, time

stage = sys.argv[1]
if stage == "importing":  # the console script (service.entry) while it imports the CLI
    class SlowImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "service.cli":
                print("HELD importing", flush=True)
                time.sleep(60)
            return None
    sys.meta_path.insert(0, SlowImport())
    sys.argv = ["loraplex", *sys.argv[2:]]
    from service.entry import main
    sys.exit(main())

from service import cli
from service.api import runtime
if stage == "starting":  # before the event loop: as if `import torch` were still running
    settings_of = cli.serve_settings
    def slow_settings(args, env=None):
        print("HELD starting", flush=True)
        time.sleep(60)
        return settings_of(args, env)
    cli.serve_settings = slow_settings
else:  # the model load, on its own thread, never ends
    def endless_load(self):
        print("HELD loading", flush=True)
        threading.Event().wait()
    runtime.Runtime.load = endless_load
sys.exit(cli.main(sys.argv[2:]))
"""


def _held(stage: str, served_tiny_dir: Path, port: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", HELD_STAGE, stage, "serve", "--model", str(served_tiny_dir), "--port", str(port)]
    cmd += ["--metrics-port", "-1", "--http-port", "0", "--dtype", "float32"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(stream: IO[str], marker: str) -> str:
    seen = []
    for line in stream:
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"{marker!r} never came: {''.join(seen)[-2000:]}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("stage", ["importing", "starting", "loading"])
def test_a_stop_signal_during_start_up_is_a_logged_exit_zero(
    served_tiny_dir: Path, free_port: int, stage: str, sig: signal.Signals
) -> None:
    proc = _held(stage, served_tiny_dir, free_port)
    try:
        assert proc.stdout is not None
        _read_until(proc.stdout, f"HELD {stage}")
        if stage == "loading":
            with grpc.insecure_channel(f"127.0.0.1:{free_port}") as channel:  # up, not serving: it is loading
                assert health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        proc.send_signal(sig)
        rc = proc.wait(60)  # the load never ends: the process does not wait for it
        output = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert rc == 0, output[-2000:]
    logged = "starting" if stage == "importing" else stage  # before the event loop, both
    assert f"event=stopped signal={sig.name} stage={logged}" in output, output[-2000:]
    if stage == "loading":
        assert f"event=startup_interrupted signal={sig.name} stage=loading" in output
    assert "Traceback" not in output, output[-2000:]
