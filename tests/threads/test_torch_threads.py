"""Only the engine thread runs torch's parallel kernels (service.torch_threads): every other thread the server starts
runs torch with one thread, the model load runs on a thread that is gone once the server is SERVING, and a count
a thread sets stays its own whatever other threads set later (torch's per-thread start would otherwise replace it
with the last count any thread set: the engine ran single-threaded behind a serial tokenizer thread)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from loraplex.v1 import generation_pb2_grpc
from support.servers import text_req

from service.torch_threads import in_own_thread, name_os_thread, os_name, serial_torch, set_threads


def _in_thread(first: Callable[[], None], then: Callable[[], None]) -> int:
    """Run ``first`` on a new thread, ``then`` on another while it waits, and return the first thread's count."""
    ready, go, seen = threading.Event(), threading.Event(), []

    def run() -> None:
        first()
        ready.set()
        go.wait()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=run)
    thread.start()
    ready.wait()
    other = threading.Thread(target=then)
    other.start()
    other.join()
    go.set()
    thread.join()
    return seen[0]


def test_a_count_set_stays_the_threads_own() -> None:
    assert _in_thread(lambda: set_threads(2), serial_torch) == 2
    assert _in_thread(serial_torch, lambda: set_threads(2)) == 1


def test_plain_set_num_threads_is_replaced_by_a_later_threads_count() -> None:
    """Why ``set_threads`` exists: torch's own call, made before the thread's first kernel, does not stick."""
    assert _in_thread(lambda: torch.set_num_threads(2), serial_torch) == 1


def test_in_own_thread_returns_raises_and_leaves_no_thread() -> None:
    seen: list[tuple[str, int]] = []

    def work() -> int:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return 42

    def fail() -> None:
        raise ValueError("bad weights")

    async def main() -> None:
        assert await in_own_thread(work, threads=2, name="probe-load") == 42
        with pytest.raises(ValueError, match="bad weights"):
            await in_own_thread(fail, threads=2, name="probe-load")

    asyncio.run(main())
    assert seen == [("probe-load", 2)]
    assert not [t for t in threading.enumerate() if t.name == "probe-load"]


def test_only_the_engine_thread_runs_parallel_kernels(tiny_server: Callable[..., Any]) -> None:
    srv = tiny_server(threads=2, adaptive_threads=False)
    loaded = srv.server.runtime.loaded
    seen: dict[str, int] = {}

    def probe(_module: object, _args: object) -> None:
        seen[threading.current_thread().name] = torch.get_num_threads()

    hook = loaded.engine.model.register_forward_pre_hook(probe)  # every pass, one compiled call or per op
    try:
        with grpc.insecure_channel(srv.target) as channel:
            generation_pb2_grpc.GenerationStub(channel).Generate(text_req("hello there", n=4), timeout=60)
    finally:
        hook.remove()
    assert seen == {"loraplex-engine": 2}  # after the tokenizer's serial thread has run

    async def elsewhere() -> dict[str, int]:
        runtime = srv.server.runtime
        return {
            "loop": torch.get_num_threads(),
            "to_thread": await asyncio.to_thread(torch.get_num_threads),
            "tokenize pool": await runtime.off_loop(torch.get_num_threads),
        }

    assert srv.call(elsewhere()) == {"loop": 1, "to_thread": 1, "tokenize pool": 1}
    assert not [t for t in threading.enumerate() if t.name == "loraplex-model-load"]


def _os_names() -> list[str]:
    """The OS names (comm) of this process's threads."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append((task / "comm").read_text().strip())
    return names


def test_os_names_are_the_python_names_shortened() -> None:
    assert os_name("loraplex-engine") == "lp-engine"
    assert os_name("loraplex-tokenize_0") == "lp-tokenize_0"
    assert os_name("loraplex-grammar_12345") == "lp-grammar_1234"  # the kernel keeps 15 bytes
    assert os_name("probe") == "probe"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")
def test_a_thread_takes_its_name_in_the_os() -> None:
    seen: list[str] = []

    def run() -> None:
        name_os_thread()
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=run, name="loraplex-probe")
    thread.start()
    thread.join()
    assert seen == ["lp-probe"]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")
def test_the_servers_threads_are_named_in_the_os(tiny_server: Callable[..., Any]) -> None:
    """``top -H``, ``perf`` and py-spy tell the engine (and its OpenMP workers) from the pools."""
    srv = tiny_server(threads=2, adaptive_threads=False)
    with grpc.insecure_channel(srv.target) as channel:
        generation_pb2_grpc.GenerationStub(channel).Generate(text_req("hello there", n=4), timeout=60)
    names = _os_names()
    assert "lp-engine" in names
    assert any(n.startswith("lp-tokenize") for n in names)


def test_in_own_thread_outliving_its_loop_ends_quietly() -> None:
    """The server stopped while the load ran: the awaiting coroutine is gone and the loop closed; the thread ends
    without an error of its own."""
    release, errors = threading.Event(), []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:

        async def main() -> None:
            task = asyncio.ensure_future(in_own_thread(release.wait, threads=1, name="probe-outlived"))
            await asyncio.sleep(0.05)
            task.cancel()

        asyncio.run(main())
        release.set()
        for t in [t for t in threading.enumerate() if t.name == "probe-outlived"]:
            t.join(10)
    finally:
        threading.excepthook = previous
    assert errors == []
