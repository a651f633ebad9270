"""What the servicers share: settings, the loaded model, tokenizer and engine, and the serving state.

``Runtime.load`` runs on a worker thread while the gRPC server is already up (health NOT_SERVING); until it
finishes, and while draining, generation RPCs get UNAVAILABLE.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from service.config import Settings
from service.engine.engine import Engine
from service.engine.request import GenerationRequest, RequestHandle, Sink
from service.errors import AdapterNotFound, Unavailable
from service.model.config import ModelConfig
from service.tokenizer import Tokenizer

log = logging.getLogger("loraplex.runtime")


@dataclass(frozen=True)
class Loaded:
    settings: Settings
    model_config: ModelConfig
    tokenizer: Tokenizer
    engine: Engine
    device: torch.device
    load_seconds: float

    def validate(self, request: GenerationRequest) -> None:
        if request.adapter_id is not None:
            raise AdapterNotFound(request.adapter_id)
        self.engine.validate(request)


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loaded: Loaded | None = None
        self.draining = False
        self.load_error: BaseException | None = None

    def load(self) -> Loaded:
        """Load tokenizer and weights, start the engine. Blocking: call it off the event loop."""
        from service.model.weights import load_model

        s = self.settings
        start = time.perf_counter()
        device = torch.device(s.device)
        tokenizer = Tokenizer.from_folder(s.model)
        model, cfg, stats = load_model(s.model, dtype=getattr(torch, s.dtype), device=device, mode=s.load_mode)
        engine = Engine(model, tokenizer, s)
        engine.start()
        seconds = time.perf_counter() - start
        log.info(
            "event=model_loaded path=%s mode=%s dtype=%s device=%s bytes=%d load_seconds=%.3f weights_seconds=%.3f",
            s.model, s.load_mode, s.dtype, device, stats.bytes_read, seconds, stats.total_seconds,
        )  # fmt: skip
        self.loaded = Loaded(s, cfg, tokenizer, engine, device, seconds)
        return self.loaded

    def ready(self) -> Loaded:
        if self.draining:
            raise Unavailable("the server is draining (shutting down); retry on another replica")
        if self.loaded is None:
            raise Unavailable("the model is still loading; retry shortly (health reports SERVING when ready)")
        return self.loaded

    def submit(self, request: GenerationRequest, sink: Sink) -> RequestHandle:
        loaded = self.ready()
        loaded.validate(request)
        return loaded.engine.submit(request, sink)

    def close(self) -> None:
        if self.loaded is not None:
            self.loaded.engine.stop()
