"""Regenerate the Python gRPC stubs of ``proto/loraplex/v1`` into ``clients/python/loraplex/v1``.

The stubs are committed and exist only there; ``tests/proto/test_proto_generated.py`` regenerates them into a
temporary folder and fails if anything differs, so run ``make proto`` after editing a ``.proto`` file.

Per proto file this writes ``*_pb2.py`` + ``*_pb2.pyi`` (grpcio-tools' protoc) and ``*_pb2_grpc.py``
(grpcio-tools' plugin) + ``*_pb2_grpc.pyi`` (mypy-protobuf's ``protoc-gen-mypy_grpc``, so servicers and
stubs are typed), plus an ``__init__.py`` and ``descriptors.binpb``: every proto file with its imports as one
``FileDescriptorSet`` *with source info* (the comments), which the server's reflection serves so ``grpcurl
describe`` shows them (the ``*_pb2.py`` descriptors carry none). Output is deterministic: files are listed in
sorted order and nothing in them depends on the machine or the time.

Usage: ``python scripts/gen_proto.py [--out DIR]`` (DIR receives ``loraplex/v1/...``; default
``clients/python``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = Path("loraplex") / "v1"
DEFAULT_OUT = ROOT / "clients" / "python"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi", ".binpb")
DESCRIPTOR_SET = "descriptors.binpb"
OUTPUT_SUFFIXES = (".py", ".pyi", ".binpb")
INIT_TEXT = '"""Generated protobuf / gRPC modules of the loraplex.v1 API (``make proto``; do not edit)."""\n'


def _plugin(name: str) -> Path:
    """A protoc plugin executable of mypy-protobuf, installed next to this interpreter."""
    candidates = [Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name]
    for path in candidates:
        if path.is_file():
            return path
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: install the dev extra (pip install -e '.[dev]', mypy-protobuf)")
    return Path(found)


def generate(out: Path) -> list[Path]:
    """Write the generated modules under ``out / loraplex / v1`` and return their paths, sorted."""
    from grpc_tools import protoc  # dev dependency; imported here so `--help` works without it

    protos = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    target = out / PACKAGE_DIR
    target.mkdir(parents=True, exist_ok=True)
    # Stale outputs of a deleted .proto must not survive a regeneration.
    for old in target.iterdir():
        if old.name.endswith(GENERATED_SUFFIXES):
            old.unlink()

    well_known = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--mypy_out={out}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--mypy_grpc_out={out}",
        f"--descriptor_set_out={target / DESCRIPTOR_SET}",
        "--include_source_info",
        "--include_imports",
        *protos,
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    (target / "__init__.py").write_text(INIT_TEXT)
    return sorted(p for p in target.iterdir() if p.is_file() and p.suffix in OUTPUT_SUFFIXES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder that receives loraplex/v1/")
    args = parser.parse_args(argv)
    for path in generate(args.out.resolve()):
        print(path.relative_to(args.out.resolve()).as_posix())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
