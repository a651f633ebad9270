"""SIGTERM and SIGINT for `loraplex serve`, from its first instruction to its exit.

Three phases, one outcome: a stop signal at any time ends the process with status 0 and a log line.

1. Start-up, before the event loop runs (imports, settings, torch): ``raise_on_stop``, the console script's first
   instruction (``service.entry``), makes a stop signal raise ``StopRequested`` in the main thread, which unwinds
   whatever was starting; it is logged (``log_early_stop``) and the exit status is 0.
2. From the event loop's first step, ``StopSignals`` takes the signals over (``loop.add_signal_handler``): the first
   one sets ``stopped``; the server then drains if it was serving, or abandons a model load still running.
3. After the loop has closed, ``ignore_stop`` ignores further ones, so a repeated signal cannot turn the exit
   that is under way into death by signal, and ``exit_now`` ends the process without the interpreter's teardown
   (slow with a model loaded, and unsafe under a torch thread still at work, such as a load no stop interrupts).

Nothing here runs at import, and importing it is cheap (``service.entry`` imports it before anything else); only
the main thread may install handlers (Python's rule).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "STOP_SIGNALS",
    "StopRequested",
    "StopSignals",
    "exit_now",
    "ignore_stop",
    "log_early_stop",
    "raise_on_stop",
    "restore",
]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """A stop signal arrived before the event loop took the signals over (a ``BaseException``, like
    ``KeyboardInterrupt``: it must unwind start-up code that catches ``Exception``)."""

    def __init__(self, signum: int) -> None:
        self.signal = signal.Signals(signum).name
        super().__init__(f"{self.signal} during start-up")


def _raise(signum: int, frame: FrameType | None) -> None:
    raise StopRequested(signum)


Handlers = dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None]


def raise_on_stop() -> Handlers:
    """Phase 1: from now until an event loop takes the signals, SIGTERM / SIGINT raise ``StopRequested``. Returns
    the handlers it replaced (for ``restore``)."""
    return {sig: signal.signal(sig, _raise) for sig in STOP_SIGNALS}


def restore(handlers: Handlers) -> None:
    """Put back what ``raise_on_stop`` replaced (a caller that runs `serve` in-process and goes on: tests)."""
    for sig, handler in handlers.items():
        if handler is not None:  # None: not installed from Python; nothing to put back
            signal.signal(sig, handler)


def log_early_stop(stop: StopRequested, log_settings: tuple[str, str] | None) -> None:
    """The line of a stop that came before the event loop ran; logging is set up first if it was not yet
    (``log_settings``: ``(format, level)`` when the settings were read, else text at INFO)."""
    if not logging.getLogger().handlers:
        from service import logs

        logs.configure(*(log_settings or ("text", "INFO")))
    fields = {"signal": stop.signal, "stage": "starting"}
    logging.getLogger("loraplex.server").info("event=stopped", extra={"fields": fields})


def ignore_stop() -> None:
    """Phase 3: the process is on its way out; another stop signal changes nothing."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` once the logs are flushed, skipping the interpreter's teardown: a daemon thread
    still inside torch (a model load, which cannot be interrupted) while torch's C++ state is torn down can abort
    the process (SIGABRT seen with a load stopped half-way), turning a clean stop into a crash."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StopSignals:
    """Phase 2: the running loop's handlers. ``received`` names the first signal (None before any)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        import asyncio  # here, not at the top: the console script imports this module first thing (service.entry)

        self.stopped = asyncio.Event()
        self.received: str | None = None
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.received is None:
            self.received = sig.name
        self.stopped.set()
