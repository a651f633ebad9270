"""The client subcommands of `loraplex`: generate, tokenize, info, health, adapters.

They talk to a running server through the `loraplex` client package only, never import the server's modules, and
take the same connection flags (``--target``, TLS, ``--api-key``), whose defaults read ``LORAPLEX_TARGET`` and
``LORAPLEX_API_KEY``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CLIENT_COMMANDS", "DEFAULT_TARGET", "add_client_commands"]

DEFAULT_TARGET = "127.0.0.1:50051"


def _connection_flags() -> argparse.ArgumentParser:
    """Flags shared by the client subcommands: where the server is and how to authenticate to it."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument(
        "--target", default=os.environ.get("LORAPLEX_TARGET", DEFAULT_TARGET),
        help=f"server address (default: the LORAPLEX_TARGET variable, else {DEFAULT_TARGET})",
    )  # fmt: skip
    flags.add_argument("--tls-ca", type=Path, help="TLS: trust the CA in this PEM file (default: plaintext)")
    flags.add_argument("--tls-cert", type=Path, help="mutual TLS: client certificate (PEM; with --tls-key)")
    flags.add_argument("--tls-key", type=Path, help="mutual TLS: the client certificate's private key (PEM)")
    flags.add_argument(
        "--tls-server-name", help="TLS: the name the server's certificate must carry, if not the --target host"
    )
    flags.add_argument(
        "--api-key", default=os.environ.get("LORAPLEX_API_KEY"),
        help="sent as `authorization: Bearer KEY` (default: the LORAPLEX_API_KEY variable)",
    )  # fmt: skip
    return flags


def _client(args: argparse.Namespace) -> Any:
    from loraplex import Client

    options = [] if args.tls_server_name is None else [("grpc.ssl_target_name_override", args.tls_server_name)]
    return Client(
        args.target, api_key=args.api_key, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
        options=options, timeout=getattr(args, "timeout", None),
    )  # fmt: skip


def add_client_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """generate, tokenize, info, health and adapters, each with the connection flags."""
    connection = _connection_flags()
    gen = sub.add_parser("generate", parents=[connection], help="stream a generation from a running server")
    gen.add_argument("prompt", help="the prompt (a user message, unless --raw)")
    gen.add_argument("--adapter", default="", help="adapter id (default: the base model)")
    gen.add_argument(
        "--adapter-scale",
        type=float,
        default=None,
        metavar="S",
        help="the adapter's strength: its deltas times S (default 1; |S| <= 8)",
    )
    gen.add_argument(
        "--mix",
        dest="mix",
        action="append",
        type=_weighted,
        default=[],
        metavar="ID=WEIGHT",
        help="an adapter of a weighted mixture (repeatable, in order; not with --adapter-scale)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set with this mass")
    gen.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeated tokens")
    gen.add_argument("--seed", type=int, default=None, help="seed of the request's sampler")
    gen.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is (default: apply the chat template)")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds (default none)")
    gen.add_argument("--json", action="store_true", help="print one JSON result instead of streaming text")
    _constraint_flags(gen)

    tok = sub.add_parser("tokenize", parents=[connection], help="tokenize text on a running server")
    tok.add_argument("text", help="the text to tokenize")

    sub.add_parser("info", parents=[connection], help="show the served model and limits")

    health = sub.add_parser(
        "health", parents=[connection], help="grpc.health.v1 check (an exec probe): exit 0 only when SERVING"
    )
    health.add_argument("--service", default="", help="ask about one service (default: the server as a whole)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")

    adapters = sub.add_parser(
        "adapters", parents=[connection], help="list, show, load and unload adapters on a running server"
    )
    adapters.add_argument("--json", action="store_true", help="JSON output")
    verbs = adapters.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="one line per adapter: id, kind, state, rank, bytes, hits, source")
    show = verbs.add_parser("show", help="everything about one adapter")
    show.add_argument("id", help="adapter id")
    load = verbs.add_parser(
        "load", help="register SOURCE as ID: an adapter folder's path on the server, or hf://org/name[@revision]"
    )
    load.add_argument("id", help="adapter id to register")
    load.add_argument(
        "path",
        metavar="SOURCE",
        help="a folder path on the server, or hf://org/name[@revision] (a snapshot in the server's local Hugging "
        "Face cache, never downloaded); either must lie inside the server's allowed adapter roots",
    )
    unload = verbs.add_parser("unload", help="remove an adapter (refused while requests use it)")
    unload.add_argument("id", help="adapter id")


def _schema_arg(value: str) -> str:
    """``--json-schema``: JSON text (it starts with ``{``), else the path of a file holding it."""
    if value.lstrip().startswith("{"):
        return value
    return _file_arg(value)


def _file_arg(value: str) -> str:
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {value}: {exc}") from None


def _weighted(text: str) -> tuple[str, float]:
    """``ID=WEIGHT`` of ``--mix``."""
    adapter_id, sep, weight = text.rpartition("=")
    try:
        if not sep or not adapter_id:
            raise ValueError
        return adapter_id, float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=WEIGHT (a number), got {text!r}") from None


def _constraint_flags(gen: argparse.ArgumentParser) -> None:
    """The output constraint of ``generate`` (structured output): at most one of the kinds."""
    group = gen.add_argument_group("output constraint (at most one)")
    kinds = group.add_mutually_exclusive_group()
    kinds.add_argument(
        "--json-schema", type=_schema_arg, metavar="FILE_OR_JSON",
        help="the output is JSON valid against this JSON Schema (inline JSON text, or a file holding it)",
    )  # fmt: skip
    kinds.add_argument("--json-object", action="store_true", help="the output is a JSON object (any)")
    kinds.add_argument("--regex", metavar="PATTERN", help="the whole output matches this regular expression")
    kinds.add_argument(
        "--grammar", type=_file_arg, metavar="FILE", help="the output is a sentence of the grammar in FILE"
    )
    kinds.add_argument(
        "--choice", action="append", metavar="S", help="the output is exactly one of these strings (repeatable)"
    )
    group.add_argument(
        "--grammar-dialect", choices=("lark", "gbnf"), default=None,
        help="the syntax of --grammar: lark (default; start rule `start`) or gbnf (llama.cpp; start rule `root`)",
    )  # fmt: skip


def _constraint_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {
        "json_schema": args.json_schema,
        "json_object": args.json_object,
        "regex": args.regex,
        "grammar": args.grammar,
        "grammar_dialect": args.grammar_dialect,
        "choice": args.choice,
    }
    return {k: v for k, v in options.items() if v not in (None, False)}


def _generate(args: argparse.Namespace) -> int:
    if args.grammar_dialect is not None and args.grammar is None:
        print("loraplex generate: --grammar-dialect is only for --grammar", file=sys.stderr)
        return 2
    options: dict[str, Any] = {
        "adapter": args.adapter or None,
        "adapter_scale": args.adapter_scale,
        "adapters": args.mix or None,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
        "stop": args.stop,
        "chat": not args.raw,
        "timeout": args.timeout,
        **_constraint_options(args),
    }
    with _client(args) as client:
        try:
            if args.json:
                result = client.generate(args.prompt, return_token_ids=True, **options)
                print(json.dumps(_plain(result), indent=2))
                return 0
            chunks = client.stream(args.prompt, **options)
        except ValueError as exc:  # the client's own argument checks (a schema that is not JSON, an empty --choice)
            print(f"loraplex generate: {exc}", file=sys.stderr)
            return 2
        for chunk in chunks:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(json.dumps(_plain(client.tokenize(args.text))))
    return 0


def _info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(json.dumps(_plain(client.model_info()), indent=2))
    return 0


def _health(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.health(args.service)
    print(status.name)
    return 0 if status.name == "SERVING" else 1


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
    with _client(args) as client:
        if args.verb == "list":
            infos = client.list_adapters()
            if args.json:
                print(json.dumps(_plain(infos), indent=2, default=str))
                return 0
            print(
                f"{'ID':<24} {'KIND':<12} {'STATE':<11} {'RANK':>4} {'DEVICE_BYTES':>12} {'HOST_BYTES':>10} "
                f"{'HITS':>6} SOURCE"
            )
            for a in infos:
                print(
                    f"{a.id:<24} {a.kind.value:<12} {a.state.value:<11} {a.rank:>4} {a.device_bytes:>12} "
                    f"{a.host_bytes:>10} {a.hits:>6} {a.source}"
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


CLIENT_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "generate": _generate,
    "tokenize": _tokenize,
    "info": _info,
    "health": _health,
    "adapters": _adapters,
}
