"""``loraplex convert KIND SRC DST``: published adapter files into the layout the server reads, offline.

Kept out of ``service.cli`` so that module stays the serve/client entry point; the work itself lives with each
format (``service.adapters.medusa.convert``). Nothing here is imported by the server.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from service.errors import LoraplexError

__all__ = ["add_convert_command", "run_convert"]


def add_convert_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    convert = sub.add_parser("convert", help="convert published adapter files into the layout loraplex serves")
    kinds = convert.add_subparsers(dest="kind", required=True)
    medusa = kinds.add_parser(
        "medusa",
        help="FasterDecoding medusa_lm_head.pt (pickle, read with weights_only) -> config.json + safetensors",
    )
    medusa.add_argument("src", type=Path, help="medusa_lm_head.pt, or the folder holding it (and its config.json)")
    medusa.add_argument("dst", type=Path, help="the new Medusa folder to write (must not exist, or be empty)")
    medusa.add_argument("--model", type=Path, help="also check the result against this base model folder")


def run_convert(args: argparse.Namespace) -> int:
    """Convert, print what was written (notes to stderr); a typed error is reported by ``cli.main`` (exit 2)."""
    from service.adapters.medusa.convert import convert_medusa

    done = convert_medusa(args.src, args.dst)
    for note in done.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.model is not None:
        from service.adapters.medusa.format import index_medusa
        from service.model.config import ModelConfig

        try:
            index_medusa(done.folder, ModelConfig.from_hf(args.model))  # names every tensor that does not fit
        except LoraplexError:
            shutil.rmtree(done.folder, ignore_errors=True)
            print(f"note: {done.folder} removed: the heads do not fit {args.model}", file=sys.stderr)
            raise
    shared = f", {done.shared_tensors} shared tensor(s) copied" if done.shared_tensors else ""
    print(
        f"{done.folder}: {done.num_heads} Medusa v{done.version} head(s) x {done.num_layers} block(s), "
        f"{str(done.dtype).removeprefix('torch.')}{shared}"
    )
    return 0
