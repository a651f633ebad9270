"""The flags of `loraplex serve`, as data: one ``Flag`` per flag, in titled groups (``SERVE_FLAGS``).

Each flag sets the ``Settings`` field of its name and has no default of its own, so an unset flag leaves the
field's default or its ``LORAPLEX_*`` variable in place. ``scripts/gen_flags.py`` writes docs/flags.md from these
definitions (``make docs``); a test fails when that page is stale.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from service.config import DTYPES, LOAD_MODES, QUANTIZE, WEIGHTS
from service.errors import LoraplexError
from service.hf_cache import AdapterSource, parse_source
from service.logs import LOG_FORMATS, LOG_LEVELS

__all__ = ["SERVE_FLAGS", "Flag", "add_serve_flags"]


def _adapter_pair(text: str) -> tuple[str, AdapterSource]:
    key, sep, source = text.partition("=")
    if not sep or not key or not source:
        raise argparse.ArgumentTypeError(f"expected ID=PATH or ID=hf://org/name[@revision], got {text!r}")
    try:
        return key, parse_source(source)
    except LoraplexError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Flag:
    """One `loraplex serve` flag as data: its name, help and the other ``add_argument`` options. None has a default
    of its own: an unset flag leaves the Settings default, or its ``LORAPLEX_*`` variable, in place."""

    def __init__(self, name: str, help: str, **options: Any) -> None:
        self.name, self.help, self.options = name, help, options


# The model, its device and dtype, where to listen, the metrics endpoint.
MODEL_FLAGS = (
    Flag("--model", "HF-format model folder (default models/SmolLM2-135M-Instruct)", type=Path),
    Flag("--device", "cpu, cuda, cuda:N (default cpu)"),
    Flag("--dtype", "serving dtype (default auto: bfloat16 on CPUs with native bf16 and on GPUs, else float32)",
         choices=DTYPES),
    Flag("--load-mode", "weight loading: stream (default), mmap, eager", choices=LOAD_MODES),
    Flag("--quantize", "weight-only quantization of every layer's projections while loading (default none)",
         choices=QUANTIZE),
    Flag("--quantize-group-size", "int4: input columns per scale and zero, 32 (default), 64 or 128", type=int),
    Flag("--gguf", "serve the weights of this llama.cpp GGUF file (Q4_0/Q4_1 as int4, Q8_0 as int8 blocks) "
         "instead of --model's safetensors; config and tokenizer still come from --model", type=Path,
         metavar="PATH"),
    Flag("--weights", "given (default): serve what --gguf / --model name; auto: serve --gguf's blocks or the "
         "folder, whichever this CPU runs best (bf16 GGUF where bf16 is native, else the float32 folder)",
         choices=WEIGHTS),
    Flag("--dense-copies-mb", "with --quantize or --gguf: keep dense copies of the compact weights, up to this many "
         "MiB (-1 = all, default 0 = none), and use them for large batches: the 4-bit kernel's speed at small "
         "batches, dense speed at large ones, for the memory of both", type=int, metavar="MIB"),
    Flag("--host", "gRPC bind address (default 127.0.0.1)"),
    Flag("--port", "gRPC port (default 50051)", type=int),
    Flag("--http-port", "OpenAI-compatible HTTP API port on --host (default 8000; 0 = any free port, -1 = off)",
         type=int),
    Flag("--metrics-host", "/metrics bind address (default 127.0.0.1)"),
    Flag("--metrics-port", "/metrics port (default 9400; 0 = any free port, -1 = off)", type=int),
    Flag("--metrics-adapter-series",
          'distinct `adapter` label values on per-adapter metrics (default 32; the rest count as "other")',
         type=int, metavar="N"),
)  # fmt: skip
# Engine threads and the per-request and queue bounds, shutdown grace.
LIMIT_FLAGS = (
    Flag("--threads", "most torch intra-op threads (default: min(CPU affinity, cgroup CPU quota, physical cores))",
         type=int),
    Flag("--adaptive-threads", "measure decode steps and use fewer threads while the CPUs are contended (default on)",
         action=argparse.BooleanOptionalAction, default=None),
    Flag("--max-batch-size", "rows per decode step (default 32)", type=int),
    Flag("--max-queue", "queued requests before RESOURCE_EXHAUSTED (default 256)", type=int),
    Flag("--max-prompt-tokens", "longest prompt accepted (default 2048)", type=int),
    Flag("--max-new-tokens", "largest max_new_tokens accepted (default 1024)", type=int),
    Flag("--max-total-tokens", "prompt + generated per request (default 4096)", type=int),
    Flag("--max-prompt-bytes",
         "UTF-8 bytes of one prompt, refused before tokenization (default 0 = 128 x --max-prompt-tokens)", type=int),
    Flag("--max-chat-messages", "chat messages in one input (default 1024)", type=int),
    Flag("--max-stop-sequences", "stop sequences per request (default 16)", type=int),
    Flag("--max-stop-sequence-bytes", "UTF-8 bytes of each stop sequence (default 1024)", type=int),
    Flag("--grace-seconds", "drain time on SIGTERM (default 10)", type=float),
    Flag("--prefill-chunk-tokens",
         "prompt tokens per prefill pass between decode steps, so long prompts cannot stall running streams "
         "(default 256; 0 = prefill whole prompts)", type=int),
)  # fmt: skip
# Adapters to register, where LoadAdapter may read, the adapter caches, the prefix cache and Medusa.
ADAPTER_FLAGS = (
    Flag("--adapter", "register an adapter at start-up: a folder, or hf://org/name[@rev] in the HF cache (repeatable)",
         dest="adapters", action="append", type=_adapter_pair, metavar="ID=SOURCE"),
    Flag("--hf-hub-cache", "where hf:// sources are looked up, never downloaded (default: HF_HUB_CACHE, HF_HOME/hub, "
         "~/.cache/huggingface/hub)", type=Path, metavar="DIR"),
    Flag("--adapter-dir", "register every adapter folder under DIR lazily at start-up (repeatable)",
         dest="adapter_dirs", action="append", type=Path, metavar="DIR"),
    Flag("--adapter-root", "more folders LoadAdapter may read from, added to the --adapter-dir folders (repeatable)",
         dest="adapter_roots", action="append", type=Path, metavar="DIR"),
    Flag("--adapter-device-budget-bytes", "device-tier adapter cache budget", type=int),
    Flag("--adapter-host-budget-bytes", "host-tier adapter cache budget", type=int),
    Flag("--prefix-cache-bytes", "K/V of prompt prefixes kept for reuse (default 256 MiB; 0 = off)", type=int),
    Flag("--prefix-block-tokens", "prefix cache granularity in tokens (default 16)", type=int),
    Flag("--draft-threshold",
         "Medusa: verify draft i only while the heads' probability that drafts 1..i are all right is >= this",
         type=float),
    Flag("--speculate-tree",
         "Medusa draft tree: 'chain' (top-1 per head) or rank paths, e.g. '0;1;0.0;1.0;0.0.0'"),
    Flag("--speculate-adaptive",
         "measure plain and speculative decode steps per batch size and use the faster (default on)",
         action=argparse.BooleanOptionalAction, default=None),
    Flag("--speculate-max-batch", "Medusa speculation off above this batch size", type=int),
)  # fmt: skip
# TLS, API keys, message size and connection age.
SECURITY_FLAGS = (
    Flag("--tls-cert", "serve gRPC over TLS with this certificate chain (PEM)", type=Path),
    Flag("--tls-key", "the private key of --tls-cert (PEM)", type=Path),
    Flag("--tls-client-ca", "mutual TLS: require client certificates signed by this CA", type=Path),
    Flag("--api-key-file",
         "API keys, one ROLE:KEY per line (roles: generate, admin); keys in LORAPLEX_API_KEYS are admin keys",
         type=Path, metavar="PATH"),
    Flag("--max-message-bytes", "largest gRPC message, both ways (default 4 MiB)", type=int),
    Flag("--max-connection-age-seconds",
         "close connections after this long, so clients rebalance (default 300; 0 = never)", type=float),
    Flag("--max-connection-age-grace-seconds",
         "how long calls running on an aged connection may still take (default inf: never cut)", type=float),
)  # fmt: skip
# Server logs (service.logs).
LOG_FLAGS = (
    Flag("--log-format", "text (key=value, default) or json (one object per line)", choices=LOG_FORMATS),
    Flag("--log-level", "root log level (default INFO; every request's access line is INFO)",
         choices=LOG_LEVELS, type=str.upper),
)  # fmt: skip


SERVE_FLAGS: tuple[tuple[str, tuple[Flag, ...]], ...] = (
    ("Model, weights and listeners", MODEL_FLAGS),
    ("Engine threads, request limits and shutdown", LIMIT_FLAGS),
    ("Adapters, caches and Medusa", ADAPTER_FLAGS),
    ("TLS, API keys and connections", SECURITY_FLAGS),
    ("Logs", LOG_FLAGS),
)


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """Add every `loraplex serve` flag to ``serve``, one argument group per entry of ``SERVE_FLAGS``."""
    for title, flags in SERVE_FLAGS:
        group = serve.add_argument_group(title)
        for flag in flags:
            group.add_argument(flag.name, help=flag.help, **flag.options)
