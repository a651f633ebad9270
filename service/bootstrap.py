"""The composition root: from ``Settings`` to the runtime's parts (tokenizer, model, adapters, engine), built once.

``build`` resolves the serving dtype and weight source (``service.model.dtypes``), loads the weights through the
format's entry in ``WEIGHT_FORMATS`` (a new format is one loader and one entry there; ``--quantize`` kinds are
``service.model.weights.kinds.QUANTIZERS``), records the load's metrics, keeps dense copies within their budget,
runs the start-up self-check, and assembles the adapter catalog and the engine. The engine is returned unstarted:
the API layer (``service.api.runtime``) starts it and serves the parts; nothing here knows a wire format.

Blocking and CPU-heavy: called off the event loop. ``check_open`` is called between stages so that a server
stopped meanwhile stops the build early.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from service import metrics
from service.adapters.catalog import AdapterCatalog
from service.adapters.kinds import KindContext, build_catalog
from service.config import Settings
from service.constraints.cache import GrammarCache
from service.constraints.llg import LLGuidanceBackend
from service.engine.engine import Engine
from service.errors import LoraplexError, Unavailable
from service.hf_cache import AdapterSource, HubRef
from service.kernels import native
from service.loading import LoadStats
from service.model.base_weights import ModelBaseWeights
from service.model.config import ModelConfig
from service.model.dtypes import ServingChoice, choose_serving
from service.model.llama import Llama
from service.model.load_folder import load_model
from service.model.load_gguf import load_gguf_model
from service.model.weights.dense_copies import keep_dense_copies
from service.selfcheck import SelfCheckReport, run_self_check
from service.tokenizer import Tokenizer

__all__ = [
    "ADAPTER_MARKERS",
    "WEIGHT_FORMATS",
    "Parts",
    "adapter_roots",
    "build",
    "load_weights",
    "record_load",
    "register_startup_adapters",
]

log = logging.getLogger("loraplex.runtime")

ADAPTER_MARKERS = ("adapter_config.json", "config.json")  # a LoRA, or Medusa heads

WeightLoader = Callable[[Settings, torch.dtype, torch.device], tuple[Llama, ModelConfig, LoadStats]]


def _folder(s: Settings, dtype: torch.dtype, device: torch.device) -> tuple[Llama, ModelConfig, LoadStats]:
    """A Hugging Face safetensors folder, dense or quantized while streaming (``--quantize``)."""
    quantize = None if s.quantize == "none" else s.quantize
    return load_model(
        s.model, dtype=dtype, device=device, mode=s.load_mode,
        quantize=quantize, group_size=s.quantize_group_size,  # type: ignore[arg-type]
    )  # fmt: skip


def _gguf(s: Settings, dtype: torch.dtype, device: torch.device) -> tuple[Llama, ModelConfig, LoadStats]:
    """A llama.cpp GGUF file's blocks served as stored, config and tokenizer from the folder."""
    if s.gguf is None:
        raise Unavailable("the gguf weight format needs a --gguf file")
    return load_gguf_model(s.model, s.gguf, dtype=dtype, device=device)


# ``ServingChoice.weights`` -> its loader: every weight format the server can serve.
WEIGHT_FORMATS: dict[str, WeightLoader] = {"folder": _folder, "gguf": _gguf}


def record_load(stats: LoadStats, model: Llama) -> None:
    """The base model's load metrics: duration per stage and bytes by load mode, parameter bytes, loaded."""
    for stage in ("header", "read", "convert", "total"):
        metrics.MODEL_LOAD_DURATION.labels(stage=stage, mode=stats.mode).observe(getattr(stats, f"{stage}_seconds"))
    metrics.MODEL_LOAD_BYTES.labels(mode=stats.mode).inc(stats.bytes_read)
    metrics.MODEL_PARAMETER_BYTES.set(model.parameter_bytes)
    metrics.MODEL_LOADED.set(1)


def load_weights(s: Settings, choice: ServingChoice, device: torch.device) -> tuple[Llama, ModelConfig, LoadStats]:
    """The base model in the chosen format and dtype, its load recorded, dense copies kept within their budget."""
    model, cfg, stats = WEIGHT_FORMATS[choice.weights](s, choice.dtype.dtype, device)
    record_load(stats, model)
    if s.dense_copies_mb:
        kept = keep_dense_copies(model, None if s.dense_copies_mb < 0 else s.dense_copies_mb * 2**20)
        metrics.MODEL_PARAMETER_BYTES.set(model.parameter_bytes)
        log.info("event=dense_copies budget_mb=%d bytes=%d", s.dense_copies_mb, kept)
    return model, cfg, stats


def _choose(s: Settings, device: torch.device) -> ServingChoice:
    native.configure(s.kernels, s.kernel_cache)
    fp32_blocks = s.gguf is not None and device.type == "cpu" and native.kernels() is not None
    log.info("event=native_kernels mode=%s status=%r", s.kernels, native.status())
    choice = choose_serving(s.dtype, s.weights, s.gguf is not None, device, native_q4=fp32_blocks)
    log.info("event=dtype_chosen requested=%s dtype=%s device=%s reason=%r", s.dtype, choice.dtype.name, device,
             choice.dtype.reason)  # fmt: skip
    log.info("event=weights_chosen requested=%s weights=%s reason=%r", s.weights, choice.weights,
             choice.weights_reason)  # fmt: skip
    return choice


def _self_check(model: Llama, choice: ServingChoice) -> SelfCheckReport:
    checked = run_self_check(model)  # refuses (SelfCheckFailed) before anything is served, or falls back
    fallbacks = sum(c.status.startswith("fallback") for c in checked.checks)
    metrics.SELF_CHECK_FALLBACKS.set(fallbacks)
    outcome = "fallback" if fallbacks else "ok"
    labels = {"capability": checked.capability, "dtype": checked.dtype, "weights": choice.weights}
    metrics.COMPUTE_INFO.info({**labels, "kernels": native.variant(), "self_check": outcome})
    return checked


def _catalog(s: Settings, model: Llama, device: torch.device, dtype: torch.dtype) -> AdapterCatalog:
    context = KindContext(model.cfg, device, dtype, s, adapter_roots(s), base=ModelBaseWeights(model))
    adapters = build_catalog(context)
    register_startup_adapters(adapters, s)
    return adapters


@dataclass(frozen=True)
class Parts:
    """What ``build`` made: everything the API layer serves, the engine not yet started."""

    settings: Settings
    choice: ServingChoice  # ``--dtype`` and ``--weights`` resolved
    device: torch.device
    tokenizer: Tokenizer
    model: Llama
    model_config: ModelConfig
    stats: LoadStats  # the weights' load
    self_check: SelfCheckReport  # capability, each compute path's kernel and error
    adapters: AdapterCatalog
    engine: Engine
    grammars: GrammarCache  # output constraints, compiled for this tokenizer and vocabulary


def _nothing() -> None:
    return None


def build(s: Settings, *, check_open: Callable[[], None] = _nothing) -> Parts:
    """Tokenizer, weights, self-check, adapter catalog and engine from ``s`` (see the module docstring)."""
    device = torch.device(s.device)
    tokenizer = Tokenizer.from_folder(s.model)
    check_open()
    choice = _choose(s, device)
    model, cfg, stats = load_weights(s, choice, device)
    check_open()
    checked = _self_check(model, choice)
    adapters = _catalog(s, model, device, choice.dtype.dtype)
    grammars = _grammars(s, tokenizer, cfg)
    engine = Engine(model, tokenizer, s, adapters=adapters, constraints=grammars.backend)
    return Parts(s, choice, device, tokenizer, model, cfg, stats, checked, adapters, engine, grammars)


def _grammars(s: Settings, tokenizer: Tokenizer, cfg: ModelConfig) -> GrammarCache:
    """The constraint backend for this tokenizer and the model's vocabulary, behind the compiled-grammar cache."""
    eos = frozenset(tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)
    backend = LLGuidanceBackend(tokenizer.to_json(), cfg.vocab_size, sorted(eos), max_depth=s.max_constraint_depth)
    return GrammarCache(backend, s.constraint_cache_bytes)


def adapter_roots(s: Settings) -> tuple[Path, ...]:
    """Folders adapters may be read from: the --adapter-dir folders and the folders holding the --adapter paths (the
    operator's own flags; for an hf:// source its ``models--org--name`` folder, snapshots and blobs), plus every
    --adapter-root. A root only ever adds: what the operator registered at start-up stays readable. Empty:
    LoadAdapter is refused (see ``service.frontend.adapters``)."""
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
