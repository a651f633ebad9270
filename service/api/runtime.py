"""What the servicers share: settings, the loaded model, tokenizer and engine, and the serving state.

``Runtime.load`` builds the parts (``service.bootstrap``, the composition root) on a worker thread while the gRPC
server is already up (health NOT_SERVING); until it finishes, and while draining, generation RPCs get UNAVAILABLE.

The runtime owns a small worker pool for CPU work that must not run on the event loop (the frontend's tokenization
and chat templating, large HTTP bodies' JSON); it is shut down with the runtime. The engine has its own thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from service import bootstrap
from service.adapters.catalog import AdapterCatalog
from service.config import Settings
from service.constraints.cache import GrammarCache
from service.engine.engine import Engine
from service.errors import LoraplexError, Unavailable
from service.model.config import ModelConfig
from service.selfcheck import SelfCheckReport
from service.tokenizer import Tokenizer
from service.torch_threads import pool_thread

log = logging.getLogger("loraplex.runtime")

T = TypeVar("T")

# Threads tokenizing / templating prompts. Small on purpose: the work is CPU-bound (the Rust tokenizer releases
# the GIL, jinja does not), and more threads would only compete with the engine's step for the cores.
TOKENIZE_WORKERS = 2


@dataclass(frozen=True)
class Loaded:
    settings: Settings
    model_config: ModelConfig
    tokenizer: Tokenizer
    engine: Engine
    device: torch.device
    load_seconds: float

    adapters: AdapterCatalog
    dtype: str  # the serving dtype, ``--dtype auto`` resolved (service.model.dtypes)
    self_check: SelfCheckReport  # the start-up self-check: capability, each compute path's kernel and error
    weights: str  # "folder" or "gguf": ``--weights`` resolved
    load_mode: str  # how the weights were read: ``--load-mode`` for a folder, "gguf" for a GGUF file
    grammars: GrammarCache | None = None  # compiled output constraints (service.constraints)


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loaded: Loaded | None = None
        self.draining = False
        self.load_error: BaseException | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=TOKENIZE_WORKERS, thread_name_prefix="loraplex-tokenize", initializer=pool_thread
        )
        self._closing = threading.Lock()  # close vs the end of a load running on another thread
        self._closed = False

    def load(self) -> Loaded:
        """Build the runtime's parts (``service.bootstrap``), start the engine. Blocking: call it off the event loop."""
        s = self.settings
        start = time.perf_counter()
        parts = bootstrap.build(s, check_open=self._check_open)
        engine, adapters, choice, stats = parts.engine, parts.adapters, parts.choice, parts.stats
        with self._closing:
            self._check_open()
            engine.start()
        seconds = time.perf_counter() - start
        log.info(
            "event=model_loaded path=%s weights=%s mode=%s dtype=%s quantize=%s device=%s bytes=%d parameter_bytes=%d "
            "load_seconds=%.3f weights_seconds=%.3f",
            s.model, s.gguf if choice.gguf else "safetensors", stats.mode, choice.dtype.name, s.quantize,
            parts.device, stats.bytes_read, parts.model.parameter_bytes, seconds, stats.total_seconds,
        )  # fmt: skip
        with self._closing:
            self.loaded = Loaded(
                s, parts.model_config, parts.tokenizer, engine, parts.device, seconds, adapters, choice.dtype.name,
                parts.self_check, choice.weights, stats.mode, parts.grammars,
            )  # fmt: skip
            if self._closed:  # closed between the engine's start and here: close did not see it
                engine.stop(0)
                adapters.close(0)
                raise Unavailable("the server was stopped while the model was loading")
        return self.loaded

    def ready(self) -> Loaded:
        if self.draining:
            raise Unavailable("the server is draining (shutting down); retry on another replica")
        if self.loaded is None:
            raise Unavailable("the model is still loading; retry shortly (health reports SERVING when ready)")
        return self.loaded

    def knows_adapter(self, adapter_id: str) -> bool:
        """Whether ``adapter_id`` is registered now (False for "" and before the model is loaded)."""
        if not adapter_id or self.loaded is None:
            return False
        try:
            self.loaded.adapters.resolve(adapter_id)
        except LoraplexError:
            return False
        return True

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the worker pool, awaited from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the pool, the engine and the adapter loaders, waiting up to ``timeout`` seconds in all for their
        threads (daemons: one still busy is left to end with the process). A load still running stops at its next
        stage and starts no engine."""
        until = None if timeout is None else time.monotonic() + timeout
        with self._closing:
            self._closed = True
            loaded = self.loaded
        self._pool.shutdown(wait=False, cancel_futures=True)
        if loaded is not None:
            if loaded.grammars is not None:
                loaded.grammars.close()
            loaded.engine.stop(_left(until))
            loaded.adapters.close(_left(until))

    def _check_open(self) -> None:
        """Between the load's stages: stop when the server was stopped meanwhile."""
        if self._closed:
            raise Unavailable("the server was stopped while the model was loading")


def _left(until: float | None) -> float | None:
    return None if until is None else max(0.0, until - time.monotonic())
