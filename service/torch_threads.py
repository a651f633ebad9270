"""Which threads of the process run torch's parallel kernels: the engine's, and the model load's while it lasts.

    set_threads(n)                    the calling thread runs torch with ``n`` intra-op threads, from now on
    serial_torch()                    set_threads(1)
    name_os_thread()                  the calling thread's name in the OS too (``top -H``, ``perf``, py-spy)
    pool_thread()                     a pool's initializer: both of the above
    await in_own_thread(fn, threads)  fn() on a new thread with ``threads`` intra-op threads; the thread then exits

Why: torch's OpenMP runtime (libgomp) keeps the workers of every thread that has run a parallel region until that
thread exits, and once the workers it manages outnumber the CPUs it stops spinning between regions: every
parallel kernel of the engine then waits for its workers' futex wake-ups. A decode step is hundreds of short
kernels, so this costs more than the kernels: a batch-1 step of SmolLM2 took 28 ms instead of 12 on 2 CPUs once
the thread that loaded the model had run parallel copies (bench/README.md, "One thread runs parallel kernels").

So every thread the service starts other than the engine's runs torch serially (their work is small: headers,
adapter tensors, token ids), and the model load, which does benefit from parallel kernels, runs on a thread of
its own that exits when the load ends, which frees its workers. ``ThreadControl`` sets the engine thread's count.

torch's ``set_num_threads`` also sets the count that a thread which has not used torch yet takes on its first
kernel, replacing what that thread set before: ``set_threads`` makes torch take its per-thread start first, so
the count set stays the thread's own whatever other threads set later.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["in_own_thread", "name_os_thread", "os_name", "pool_thread", "serial_torch", "set_threads"]

T = TypeVar("T")


def set_threads(n: int) -> None:
    """Run torch with ``n`` intra-op threads on the calling thread, whatever other threads set afterwards."""
    torch.get_num_threads()  # torch's lazy per-thread start: taken now, it cannot override ``n`` later
    torch.set_num_threads(n)


def serial_torch() -> None:
    """Run torch single-threaded on the calling thread: it never starts OpenMP workers of its own."""
    set_threads(1)


_PR_SET_NAME = 15  # linux/prctl.h
_OS_NAME_BYTES = 15  # the kernel keeps 15 bytes of a thread's name


def os_name(name: str) -> str:
    """A thread's OS name for its Python name: ``loraplex-engine`` -> ``lp-engine``, at most 15 bytes."""
    short = "lp-" + name.removeprefix("loraplex-") if name.startswith("loraplex-") else name
    return short.encode()[:_OS_NAME_BYTES].decode(errors="ignore")


def name_os_thread() -> None:
    """Give the calling thread its Python name (``os_name``) in the OS as well, where ``top -H``, ``ps -L``,
    ``perf`` and /proc/PID/task/*/comm show it; threads it starts later inherit it (the engine's OpenMP workers
    show as ``lp-engine`` too). Linux only; elsewhere, or if the call fails, nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    name = os_name(threading.current_thread().name).encode()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name, 0, 0, 0)


def pool_thread() -> None:
    """A worker pool's initializer: the thread named in the OS (``name_os_thread``) and torch serial on it."""
    name_os_thread()
    serial_torch()


async def in_own_thread(fn: Callable[[], T], *, threads: int, name: str) -> T:
    """``fn()`` on a new thread named ``name`` running torch with ``threads`` intra-op threads, awaited from the
    event loop. The thread exits when ``fn`` returns or raises, and its OpenMP workers with it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def hand_over(result: T | None, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed (the server stopped meanwhile): nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    def run() -> None:
        name_os_thread()
        set_threads(threads)
        try:
            result = fn()
        except BaseException as e:  # handed to the awaiting coroutine, never lost on this thread
            hand_over(None, e)
            return
        hand_over(result, None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        return await done  # fn's result or error, or CancelledError (the thread then finishes on its own, unwaited)
    finally:
        if not done.cancelled():  # returned or raised: the thread is exiting, and its workers are gone once it has
            await asyncio.to_thread(thread.join)
