"""What the servicers share: settings, the loaded model, tokenizer and engine, and the serving state.

``Runtime.load`` runs on a worker thread while the gRPC server is already up (health NOT_SERVING); until it
finishes, and while draining, generation RPCs get UNAVAILABLE.

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
from pathlib import Path
from typing import TypeVar

import torch

from service import metrics
from service.adapters import AdapterStore
from service.adapters.catalog import AdapterCatalog
from service.adapters.registry import resolve_source
from service.config import Settings
from service.engine.engine import Engine
from service.errors import LoraplexError, Unavailable
from service.hf_cache import AdapterSource, HubRef
from service.medusa.registry import MedusaRegistry
from service.model.config import ModelConfig
from service.model.dtypes import choose_serving
from service.selfcheck import SelfCheckReport, run_self_check
from service.tokenizer import Tokenizer
from service.torch_threads import serial_torch

log = logging.getLogger("loraplex.runtime")

T = TypeVar("T")

# Threads tokenizing / templating prompts. Small on purpose: the work is CPU-bound (the Rust tokenizer releases
# the GIL, jinja does not), and more threads would only compete with the engine's step for the cores.
TOKENIZE_WORKERS = 2

ADAPTER_MARKERS = ("adapter_config.json", "config.json")  # a LoRA, or Medusa heads


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


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loaded: Loaded | None = None
        self.draining = False
        self.load_error: BaseException | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=TOKENIZE_WORKERS, thread_name_prefix="loraplex-tokenize", initializer=serial_torch
        )
        self._closing = threading.Lock()  # close vs the end of a load running on another thread
        self._closed = False

    def load(self) -> Loaded:
        """Load tokenizer and weights, start the engine. Blocking: call it off the event loop."""
        from service.model.quant import keep_dense_copies
        from service.model.weights import load_model

        s = self.settings
        start = time.perf_counter()
        device = torch.device(s.device)
        tokenizer = Tokenizer.from_folder(s.model)
        self._check_open()
        choice = choose_serving(s.dtype, s.weights, s.gguf is not None, device)
        log.info("event=dtype_chosen requested=%s dtype=%s device=%s reason=%r", s.dtype, choice.dtype.name, device,
                 choice.dtype.reason)  # fmt: skip
        log.info("event=weights_chosen requested=%s weights=%s reason=%r", s.weights, choice.weights,
                 choice.weights_reason)  # fmt: skip
        dtype = choice.dtype.dtype
        if choice.gguf and s.gguf is not None:
            from service.model.gguf_weights import load_gguf_model

            model, cfg, stats = load_gguf_model(s.model, s.gguf, dtype=dtype, device=device)
        else:
            quantize = None if s.quantize == "none" else s.quantize
            model, cfg, stats = load_model(
                s.model, dtype=dtype, device=device, mode=s.load_mode,
                quantize=quantize, group_size=s.quantize_group_size,  # type: ignore[arg-type]
            )  # fmt: skip
        if s.dense_copies_mb:
            kept = keep_dense_copies(model, None if s.dense_copies_mb < 0 else s.dense_copies_mb * 2**20)
            metrics.MODEL_PARAMETER_BYTES.set(model.parameter_bytes)
            log.info("event=dense_copies budget_mb=%d bytes=%d", s.dense_copies_mb, kept)
        self._check_open()
        checked = run_self_check(model)  # refuses (SelfCheckFailed) before anything is served, or falls back
        fallbacks = sum(c.status.startswith("fallback") for c in checked.checks)
        metrics.SELF_CHECK_FALLBACKS.set(fallbacks)
        outcome = "fallback" if fallbacks else "ok"
        metrics.COMPUTE_INFO.info(
            {"capability": checked.capability, "dtype": checked.dtype, "weights": choice.weights, "self_check": outcome}
        )
        roots = adapter_roots(s)
        store = AdapterStore(
            cfg,
            device=device,
            dtype=dtype,
            device_budget_bytes=s.adapter_device_budget_bytes,
            host_budget_bytes=s.adapter_host_budget_bytes,
            roots=roots,
        )
        medusa = MedusaRegistry(cfg, device=device, dtype=dtype, check_path=lambda p: resolve_source(p, roots))
        adapters = AdapterCatalog(store, medusa, hub_cache=s.hf_hub_cache)
        register_startup_adapters(adapters, s)
        engine = Engine(model, tokenizer, s, adapters=adapters)
        with self._closing:
            self._check_open()
            engine.start()
        seconds = time.perf_counter() - start
        log.info(
            "event=model_loaded path=%s weights=%s mode=%s dtype=%s quantize=%s device=%s bytes=%d parameter_bytes=%d "
            "load_seconds=%.3f weights_seconds=%.3f",
            s.model, s.gguf if choice.gguf else "safetensors", stats.mode, choice.dtype.name, s.quantize, device,
            stats.bytes_read,
            model.parameter_bytes, seconds, stats.total_seconds,
        )  # fmt: skip
        with self._closing:
            self.loaded = Loaded(
                s, cfg, tokenizer, engine, device, seconds, adapters, choice.dtype.name, checked, choice.weights
            )
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
            loaded.engine.stop(_left(until))
            loaded.adapters.close(_left(until))

    def _check_open(self) -> None:
        """Between the load's stages: stop when the server was stopped meanwhile."""
        if self._closed:
            raise Unavailable("the server was stopped while the model was loading")


def _left(until: float | None) -> float | None:
    return None if until is None else max(0.0, until - time.monotonic())


def adapter_roots(s: Settings) -> tuple[Path, ...]:
    """Folders adapters may be read from: the --adapter-dir folders and the folders holding the --adapter paths (the
    operator's own flags; for an hf:// source its ``models--org--name`` folder, snapshots and blobs), plus every
    --adapter-root. A root only ever adds: what the operator registered at start-up stays readable. Empty:
    LoadAdapter is refused (see ``AdaptersServicer``)."""
    own = (*s.adapter_dirs, *(_own_root(source, s.hf_hub_cache) for _, source in s.adapters))
    return tuple(dict.fromkeys((*own, *s.adapter_roots)))


def _own_root(source: AdapterSource, hub_cache: Path) -> Path:
    return source.repo_folder(hub_cache) if isinstance(source, HubRef) else source.parent


def register_startup_adapters(store: AdapterCatalog, s: Settings) -> None:
    """Register --adapter ID=SOURCE and every adapter folder under --adapter-dir (configs and headers only).

    A bad explicit --adapter fails start-up; a bad folder under --adapter-dir is logged and skipped, so one broken
    upload does not keep the server down. Folders without an adapter config (lost+found, ...) are ignored.
    """
    for adapter_id, source in s.adapters:
        store.register(adapter_id, source)
    for folder in s.adapter_dirs:
        if not folder.is_dir():
            raise Unavailable(f"--adapter-dir {folder} is not a folder")
        for child in sorted(folder.iterdir()):
            if not child.is_dir() or not any((child / f).is_file() for f in ADAPTER_MARKERS):
                continue
            try:
                store.register(child.name, child)
            except LoraplexError as exc:
                log.warning("event=adapter_skipped path=%s error=%s", child, exc)
