"""Settings: one frozen object, built in the entry point from CLI flags and ``LORAPLEX_*`` variables.

Nothing reads the environment at import time; ``Settings.from_env`` is called explicitly by the CLI, and
flags given on the command line win over the environment.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.constraints.spec import ConstraintLimits
from service.errors import InvalidRequest
from service.hf_cache import DEFAULT_HUB_CACHE, AdapterSource, hub_cache_dir, parse_source

if TYPE_CHECKING:  # the type lives with the loader; importing it at run time would pull torch into the CLI
    from service.loading import LoadMode

# The --load-mode choices: mypy checks each is a LoadMode, tests/loading/test_loading.py that none is missing.
LOAD_MODES: tuple[LoadMode, ...] = ("stream", "mmap", "eager")
# "auto": bfloat16 where the device computes it natively, float32 on other CPUs (service.model.dtypes)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# "given": what --gguf / --model name; "auto": the machine picks between --gguf's blocks and the folder (dtypes)
WEIGHTS = ("given", "auto")
QUANTIZE = ("none", "int8", "int4")  # weight-only quantization of the projections (service.model.weights.kinds)
# --kernels: loraplex's compiled CPU kernels (service.kernels.native). "auto": built for this CPU at start-up when a
# C++ compiler is there, else torch's eager kernels with a warning; "native": refuse to start without them.
KERNELS = ("auto", "native", "eager")
# The default prompt byte limit per allowed prompt token: above the longest token of common BPE vocabularies
# (SmolLM2's is 81 bytes, a run of spaces), so a prompt over the byte limit would be over the token limit too.
PROMPT_BYTES_PER_TOKEN = 128


MAX_DRAFT_NGRAM = 16  # --draft-ngram: the longest suffix prompt lookup matches
MAX_DRAFT_TOKENS = 32  # --draft-tokens: the most tokens it proposes per step
MAX_SAVED_MODULE_BYTES = 256 << 20  # an adapter's modules_to_save, serving dtype (default)
MAX_MIXTURE_ADAPTERS = 16  # --max-mixture-adapters: each adapter of a mixture is one more delta per row per layer


class ConfigError(ValueError):
    """A setting, or a file a setting names, is invalid. The message names it; `loraplex serve` prints it, exits 2."""


@dataclass(frozen=True)
class Settings:
    model: Path = Path("models/SmolLM2-135M-Instruct")
    device: str = "cpu"
    dtype: str = "auto"
    load_mode: LoadMode = "stream"
    quantize: str = "none"  # "int8" / "int4": projections quantized while streaming the checkpoint
    quantize_group_size: int = 32  # int4: input columns per scale and zero (32, 64 or 128)
    gguf: Path | None = None  # serve this llama.cpp GGUF's weights packed as stored (config, tokenizer: `model`)
    weights: str = "given"  # "auto": serve ``gguf`` or the folder, whichever this machine runs best
    dense_copies_mb: int = 0  # quantized / GGUF: MiB of dense weight copies kept for large batches; -1 = all
    kernels: str = "auto"  # KERNELS
    kernel_cache: Path | None = None  # where compiled kernels are kept; None: $XDG_CACHE_HOME/loraplex/kernels
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9400
    http_port: int = 8000  # the OpenAI-compatible HTTP API on ``host`` (service.api.http); 0 = any free port, -1 = off
    threads: int = 0  # most torch intra-op threads; 0 = min(affinity, cgroup CPU quota, physical cores)
    adaptive_threads: bool = True  # measure decode steps and use fewer threads while the CPUs are contended
    # engine limits
    max_batch_size: int = 32
    max_queue: int = 256
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 1024
    max_total_tokens: int = 4096  # prompt + generated, per request (KV cache length)
    # request field limits, checked before tokenization (docs/limits.md)
    max_prompt_bytes: int = 0  # UTF-8 bytes of one prompt; 0 = PROMPT_BYTES_PER_TOKEN x max_prompt_tokens
    max_chat_messages: int = 1024
    max_stop_sequences: int = 16
    max_stop_sequence_bytes: int = 1024
    max_constraint_bytes: int = 64 << 10  # output constraints (service.constraints.spec)
    max_constraint_choices: int = 1024
    max_constraint_depth: int = 32
    max_constraint_compile_seconds: float = 2.0  # a constraint's compile (and first mask), on the compile pool
    constraint_cache_bytes: int = 64 << 20  # compiled grammars kept for reuse (service.constraints.cache)
    grace_seconds: float = 10.0
    prefix_cache_bytes: int = 256 << 20  # K/V of prompt prefixes kept for reuse; 0 turns prefix caching off
    prefix_block_tokens: int = 16
    prefill_chunk_tokens: int = 256  # padded prompt tokens per prefill pass between decode steps; 0 = whole prompts
    # adapters
    adapters: tuple[tuple[str, AdapterSource], ...] = ()  # a folder path, or hf://org/name[@revision]
    adapter_dirs: tuple[Path, ...] = ()
    adapter_roots: tuple[Path, ...] = ()
    # where hf:// adapter sources are looked up (never downloaded); from_env: HF_HUB_CACHE / HF_HOME when unset
    hf_hub_cache: Path = DEFAULT_HUB_CACHE
    adapter_device_budget_bytes: int = 512 << 20
    adapter_host_budget_bytes: int = 2 << 30
    # CPU servers: adapters laid out past the device budget while every device-tier adapter is held (host budget)
    adapter_overflow_adapters: int = 8
    max_mixture_adapters: int = 4  # adapters one request may mix (GenerateRequest.adapters)
    max_saved_module_bytes: int = MAX_SAVED_MODULE_BYTES  # an adapter's modules_to_save, serving dtype; 0 refuses
    # speculative decoding: Medusa heads (per adapter) and the server-wide drafter
    speculate_max_batch: int = 4
    speculate_adaptive: bool = True  # measure plain vs speculative steps per batch size, use the faster
    speculate_tree: str = "chain"  # draft tree: "chain" (top-1 per head) or paths "0;1;0.0;..." (service.drafters.tree)
    draft_threshold: float = 0.0  # verify a draft only while the heads' chained confidence is at least this
    # server-wide drafter (service.drafters.registry): "none" or "prompt-lookup", for greedy rows without heads
    draft: str = "none"
    draft_ngram: int = 3  # prompt-lookup: longest suffix matched
    draft_tokens: int = 8  # prompt-lookup: tokens proposed per match
    # metrics: distinct values of the `adapter` label (first come; the rest count as adapter="other")
    metrics_adapter_series: int = 32
    # logs (service.logs): key=value text or one JSON object per line, and the root level
    log_format: str = "text"
    log_level: str = "INFO"
    # transport and access (docs/security.md)
    max_message_bytes: int = 4 << 20  # largest gRPC message, both directions (RESOURCE_EXHAUSTED beyond)
    max_connection_age_seconds: float = 300.0  # GOAWAY after this, so round_robin clients see new replicas; 0 = off
    max_connection_age_grace_seconds: float = math.inf  # then running calls may finish for this long; inf = always
    tls_cert: Path | None = None  # server certificate chain (PEM); with tls_key, gRPC is served over TLS only
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # mutual TLS: clients must present a certificate signed by this CA
    api_key_file: Path | None = None  # one ROLE:KEY per line (service.api.auth)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # LORAPLEX_API_KEYS: admin keys (compatibility)

    @property
    def prompt_bytes_limit(self) -> int:
        """UTF-8 bytes one prompt may have before tokenization: ``max_prompt_bytes``, or by default enough for
        ``max_prompt_tokens`` tokens of the longest kind, so the byte limit never refuses a prompt whose tokens fit."""
        return self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * self.max_prompt_tokens

    @property
    def constraint_limits(self) -> ConstraintLimits:
        """The bounds every output constraint meets before it is compiled."""
        return ConstraintLimits(self.max_constraint_bytes, self.max_constraint_choices, self.max_constraint_depth)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults < ``LORAPLEX_<FIELD>`` variables < ``overrides`` (the CLI flags that were given)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f"LORAPLEX_{f.name.upper()}")
            if raw is not None:
                try:
                    values[f.name] = _parse(f.name, f.default, raw)
                except ValueError as exc:
                    raise ConfigError(f"LORAPLEX_{f.name.upper()}: {exc}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        values.setdefault("hf_hub_cache", hub_cache_dir(env))  # huggingface_hub's own variables
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {self.load_mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {QUANTIZE}, got {self.quantize!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.quantize_group_size not in (32, 64, 128):
            raise ValueError(f"quantize_group_size must be 32, 64 or 128, got {self.quantize_group_size}")
        if self.dense_copies_mb < -1:
            raise ValueError(f"dense_copies_mb must be -1 (all), 0 (none) or a size in MiB, got {self.dense_copies_mb}")
        if self.dense_copies_mb and self.gguf is None and self.quantize == "none":
            raise ConfigError("dense_copies_mb applies to a quantized base (quantize int8/int4, or a gguf file)")
        if self.gguf is not None and self.device != "cpu":
            raise ConfigError(f"gguf weights are served on the CPU only, not device {self.device!r}")
        if self.gguf is not None and self.quantize != "none":
            raise ConfigError("quantize applies to safetensors checkpoints; a gguf file's blocks are served as stored")
        for name in (
            "max_batch_size", "max_queue", "max_prompt_tokens", "max_new_tokens", "max_total_tokens",
            "max_chat_messages", "max_stop_sequences", "max_stop_sequence_bytes", "max_constraint_bytes",
            "max_constraint_choices", "max_constraint_depth",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not self.max_constraint_compile_seconds > 0:
            raise ValueError("max_constraint_compile_seconds must be > 0")
        if self.constraint_cache_bytes < 0:
            raise ValueError("constraint_cache_bytes must be >= 0 (0 = no cache)")
        if self.max_prompt_bytes < 0:
            raise ValueError("max_prompt_bytes must be >= 0 (0 = derived from max_prompt_tokens)")
        from service.drafters.tree import DraftTree

        DraftTree.parse(self.speculate_tree, 64)  # ValueError names the problem
        if not 0.0 <= self.draft_threshold < 1.0:
            raise ValueError("draft_threshold must be in [0, 1)")
        self._validate_draft()
        if self.prefix_cache_bytes < 0 or self.prefix_block_tokens <= 0:
            raise ValueError("prefix_cache_bytes must be >= 0 and prefix_block_tokens > 0")
        if self.prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be >= 0 (0 = prefill whole prompts)")
        if self.adapter_overflow_adapters < 0:
            raise ValueError("adapter_overflow_adapters must be >= 0 (0 = loads wait for an unpin)")
        if not 1 <= self.max_mixture_adapters <= MAX_MIXTURE_ADAPTERS:
            raise ValueError(
                f"max_mixture_adapters must be in [1, {MAX_MIXTURE_ADAPTERS}], got {self.max_mixture_adapters}"
            )
        if self.max_saved_module_bytes < 0:
            raise ValueError("max_saved_module_bytes must be >= 0 (0 refuses every adapter with modules_to_save)")
        if self.metrics_adapter_series < 0:
            raise ValueError("metrics_adapter_series must be >= 0")
        from service.logs import LOG_FORMATS, LOG_LEVELS

        if self.log_format not in LOG_FORMATS or self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS} and log_level one of {LOG_LEVELS}")
        if self.max_total_tokens <= self.max_prompt_tokens:
            raise ValueError("max_total_tokens must exceed max_prompt_tokens")
        self._validate_transport()

    def _validate_draft(self) -> None:
        from service.drafters.registry import SERVER_DRAFTERS

        if self.draft != "none" and self.draft not in SERVER_DRAFTERS:
            raise ValueError(f"draft must be none or one of {tuple(SERVER_DRAFTERS)}, got {self.draft!r}")
        # Bounds before work: the lookup scans the row's history once per n-gram length, and every proposed token
        # is one more node each step verifies for the row.
        if self.draft_ngram < 1 or self.draft_tokens < 1:
            raise ValueError("draft_ngram and draft_tokens must be >= 1")
        if self.draft_ngram > MAX_DRAFT_NGRAM:
            raise ValueError(f"draft_ngram must be at most {MAX_DRAFT_NGRAM}, got {self.draft_ngram}")
        if self.draft_tokens > MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be at most {MAX_DRAFT_TOKENS}, got {self.draft_tokens}")

    def _validate_transport(self) -> None:
        if not 0 < self.max_message_bytes < 1 << 31:
            raise ConfigError("max_message_bytes must be in [1, 2^31)")
        if self.http_port < -1 or self.http_port > 65535:
            raise ConfigError("http_port must be a port number, 0 (any free port) or -1 (off)")
        if self.max_connection_age_seconds < 0 or not self.max_connection_age_grace_seconds >= 0:
            raise ConfigError("max_connection_age_seconds and max_connection_age_grace_seconds must be >= 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together: give both (or neither, for plaintext)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key (server TLS) too")


OPTIONAL_PATHS = frozenset({"tls_cert", "tls_key", "tls_client_ca", "api_key_file", "gguf", "kernel_cache"})


def _parse(name: str, default: Any, raw: str) -> Any:
    if name in OPTIONAL_PATHS:
        return Path(raw) if raw.strip() else None
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    if isinstance(default, Path):
        return Path(raw)
    if isinstance(default, tuple):
        items = [s for s in raw.split(",") if s.strip()]
        if name == "adapters":
            pairs = []
            for item in items:
                key, sep, source = item.partition("=")
                if not sep:
                    raise ValueError(f"LORAPLEX_ADAPTERS: expected ID=PATH, got {item!r}")
                try:
                    pairs.append((key.strip(), parse_source(source.strip())))
                except InvalidRequest as exc:
                    raise ValueError(str(exc)) from None
            return tuple(pairs)
        if name in ("adapter_dirs", "adapter_roots"):
            return tuple(Path(s.strip()) for s in items)
        return tuple(s.strip() for s in items)
    return raw
