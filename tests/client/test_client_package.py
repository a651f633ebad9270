"""``loraplex-client`` stands alone: it declares only grpcio, protobuf, googleapis-common-protos (error
details) and grpcio-health-checking (health messages), imports nothing else, and its wheel (typed: py.typed
and .pyi stubs) works with nothing but those and their own requirements on the import path. No virtualenv
is made: the wheel is unpacked with ``pip install --target`` and run with ``python -S`` and an explicit
``sys.path``."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from support.paths import ROOT

CLIENT_DIR = ROOT / "clients" / "python"


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match is not None, requirement
    return match.group(0).lower().replace("_", "-")


def _closure(dist: str) -> set[str]:
    """``dist`` and everything it requires at run time (extras excluded), as normalized names."""
    seen: set[str] = set()
    todo = [dist]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in metadata.requires(name) or []:
            if "extra ==" not in requirement:
                todo.append(_name(requirement))
    return seen


def _declared() -> list[str]:
    """The client's run-time requirements as its pyproject.toml declares them (what a wheel built now requires)."""
    project = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())["project"]
    return [str(r) for r in project["dependencies"]]


def _requirements_closure() -> set[str]:
    """Every distribution the client needs at run time: its declared requirements and theirs."""
    return set().union(*(_closure(_name(r)) for r in _declared()))


def _top_level(dist: str) -> set[str]:
    files = metadata.files(dist) or []
    names = set()
    for file in files:
        first = file.parts[0]
        if first.endswith((".dist-info", ".egg-info")) or first in ("..", "__pycache__"):
            continue
        names.add(first.removesuffix(".py"))
    return names


def test_declares_only_grpc_protobuf_and_their_common_messages() -> None:
    names = sorted(_name(r) for r in _declared())
    assert names == ["googleapis-common-protos", "grpcio", "grpcio-health-checking", "protobuf"]
    assert "grpcio-status" not in _requirements_closure()  # error details are read with the messages alone


def test_importing_the_client_loads_only_stdlib_grpc_and_protobuf() -> None:
    code = (
        "import sys, loraplex, loraplex.v1.generation_pb2_grpc, loraplex.v1.adapters_pb2_grpc\n"
        "loraplex.Client('127.0.0.1:1').close()\n"
        "print('\\n'.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    allowed = {"loraplex"} | set(sys.stdlib_module_names)
    for dist in _requirements_closure():
        allowed |= _top_level(dist)
    # grpc itself imports grpc_tools / grpc_reflection when they happen to be installed (aliases kept for
    # old code); cython's runtime modules and editable-install finders (setuptools', hatchling's) are not imports.
    incidental = {"__main__", "_distutils_hack", "cython_runtime", "grpc_tools", "grpc_reflection", "editables"}
    finders = ("__editable__", "_editable_impl_", "_cython_")
    foreign = sorted(m for m in set(out.split()) - allowed - incidental if not m.startswith(finders))
    assert not foreign, f"importing loraplex pulled in {foreign}"
    assert "service" not in out.split() and "torch" not in out.split()


@pytest.mark.slow  # pip builds a wheel (~5 s)
def test_wheel_is_typed_complete_and_runs_with_only_its_requirements(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", reason="building the wheel without isolation needs setuptools")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(CLIENT_DIR)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("loraplex_client-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package_files = {n for n in names if ".dist-info/" not in n}
    assert all(n.startswith("loraplex/") for n in package_files), package_files
    generated = {p.name for p in (CLIENT_DIR / "loraplex" / "v1").iterdir() if p.suffix in (".py", ".pyi", ".binpb")}
    assert {f"loraplex/v1/{n}" for n in generated} <= names
    assert {"loraplex/py.typed", "loraplex/__init__.py"} <= names

    # The wheel alone, plus links to its requirements' packages: nothing else importable.
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, capture_output=True)
    deps = tmp_path / "deps"
    deps.mkdir()
    for dist in sorted(_requirements_closure()):
        for file in metadata.files(dist) or []:
            if file.parts[0].endswith(".dist-info") or file.parts[0] == "..":
                continue
            source = Path(str(file.locate()))
            link = deps / file
            if source.is_file() and not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(source, link)
    code = (
        f"import sys; sys.path[:0] = [{str(target)!r}, {str(deps)!r}]\n"
        "import loraplex, grpc\n"
        "assert loraplex.__file__.startswith(sys.path[0]), loraplex.__file__\n"
        "from loraplex.v1 import generation_pb2\n"
        "client = loraplex.Client('127.0.0.1:1', timeout=5)\n"
        "try:\n"
        "    client.model_info()\n"
        "except loraplex.Unavailable as e:\n"
        "    print('unavailable', e.code.name)\n"
        "client.close()\n"
        "import importlib.util\n"
        "print('torch' if importlib.util.find_spec('torch') else 'no-torch')\n"
    )
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["unavailable", "UNAVAILABLE", "no-torch"]
