"""The server distribution declares what it imports: every third-party module under ``service/`` comes from a
distribution its pyproject.toml names, the generated stubs (``loraplex.v1``) included, whose home is the in-repo
``loraplex-client`` (clients/python). The slow test proves it the way a user meets it: ``pip install .`` of the
server alone into a fresh virtualenv, then ``import service.api.server``.

The fresh venv gets the heavy third-party wheels (torch, grpc, ...) from this interpreter's site-packages through
a plain path line (no ``.pth`` of it runs, so none of its editable installs leaks in); the server and the client
must come from pip's own resolution of ``.``, offline (``--no-index``, the build backends from the dev extra).
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from support.paths import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match is not None, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> the files under service/ that import it (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "service").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"service"}:
                found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_the_client_is_a_dependency_from_its_folder() -> None:
    (client,) = [r for r in PROJECT["dependencies"] if _name(r) == "loraplex-client"]
    assert client == "loraplex-client @ {root:uri}/clients/python"
    client_project = tomllib.loads((ROOT / "clients" / "python" / "pyproject.toml").read_text())["project"]
    assert client_project["name"] == "loraplex-client"


def test_every_third_party_import_is_declared() -> None:
    declared = {_name(r) for r in PROJECT["dependencies"]}
    convert = {_name(r) for r in PROJECT["optional-dependencies"]["convert"]}  # fetch-model only
    providers = metadata.packages_distributions()
    for top, files in _third_party_imports().items():
        dists = {_name(d) for d in providers.get(top, [])}
        assert dists, f"{top} (imported by {sorted(files)}) is installed by no distribution"
        if dists & declared:
            continue
        assert dists & convert and files <= {"service/fetch.py"}, f"{top} ({sorted(files)}) is not declared"


@pytest.mark.slow
def test_pip_install_of_the_server_alone_serves_imports(tmp_path: Path) -> None:
    pytest.importorskip("hatchling", reason="the server's build backend (dev extra)")
    pytest.importorskip("setuptools", reason="the client's build backend")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    (purelib / "shared_wheels.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # Offline: no index, no isolated build env. Every requirement but the two local packages is already on the
    # shared path, so pip resolves loraplex-client from its folder or fails.
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--disable-pip-version-check"]
    install = subprocess.run(
        [*pip, "--no-index", "--no-build-isolation", str(ROOT)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    code = "import loraplex.v1, service, service.api.server; print(service.__file__); print(loraplex.v1.__file__)"
    out = subprocess.run([python, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    for line in out.split():
        assert Path(line).is_relative_to(purelib), line  # installed into the fresh venv, not found elsewhere
    assert {p.name for p in purelib.glob("*.dist-info")} == {
        "loraplex-0.1.0.dist-info",
        "loraplex_client-0.1.0.dist-info",
    }
