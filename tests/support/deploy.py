"""Shared helpers for the deployment tests: the Kubernetes folder and versions, a kustomize-capable kubectl, an
overlay rendered with components, the rendered objects' accessors and the Dockerfile read as stages. Test modules
import these; none imports another."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from support.paths import ROOT

K8S = ROOT / "deploy" / "k8s"
# Every minor from the oldest Kubernetes the manifests target (native gRPC probes are GA since 1.27) to the newest
# schema kubernetes-validate has.
K8S_VERSIONS = tuple(f"1.{minor}.0" for minor in range(27, int(kubernetes_validate.latest_version().split(".")[1]) + 1))

Obj = dict[str, Any]


def find_kubectl() -> str:
    """A kubectl whose embedded kustomize is v4+ (the overlays use ``patches:``): PATH first, then .venv."""
    for candidate in (shutil.which("kubectl"), str(ROOT / ".venv" / "bin" / "kubectl")):
        if candidate is None or not Path(candidate).is_file():
            continue
        out = subprocess.run([candidate, "version", "--client"], capture_output=True, text=True, timeout=60)
        if re.search(r"^Kustomize Version: v([4-9]|[1-9]\d)\.", out.stdout, re.MULTILINE):
            return candidate
    pytest.fail("no kubectl with kustomize >= v4: run scripts/system_deps.sh (as root for the apt part)")


def render(tmp_path: Path, *components: str) -> list[Obj]:
    """``kubectl kustomize`` of a kustomization in ``tmp_path``: overlays/cpu plus ``components``."""
    rel = Path(os.path.relpath(K8S, tmp_path))  # kustomize refuses absolute paths
    spec = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [str(rel / "overlays" / "cpu")],
        "components": [str(rel / "components" / c) for c in components],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.run([find_kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def one(docs: list[Obj], kind: str) -> Obj:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_spec(docs: list[Obj]) -> Obj:
    spec: Obj = one(docs, "Deployment")["spec"]["template"]["spec"]
    return spec


def server_container(docs: list[Obj]) -> Obj:
    (container,) = [c for c in pod_spec(docs)["containers"] if c["name"] == "loraplex"]
    return container


def dockerfile_instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined and comments dropped."""
    lines: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            lines.append((word.upper(), rest.strip()))
            pending = ""
    return lines


@dataclasses.dataclass
class Stage:
    name: str
    base: str  # the FROM image or the name of an earlier stage
    steps: list[tuple[str, str]]


def dockerfile_stages() -> list[Stage]:
    stages: list[Stage] = []
    for word, args in dockerfile_instructions():
        if word == "FROM":
            base, _, name = args.partition(" AS ")
            stages.append(Stage(name.strip(), base.strip(), []))
        elif stages:
            stages[-1].steps.append((word, args))
    return stages


def dockerfile_entrypoint() -> list[str]:
    """The runtime (last) stage's entrypoint."""
    (entry,) = [args for word, args in dockerfile_stages()[-1].steps if word == "ENTRYPOINT"]
    command: list[str] = json.loads(entry)  # exec form: signals reach the server, not a shell
    return command


def dockerfile_user() -> str:
    users = [args for word, args in dockerfile_stages()[-1].steps if word == "USER"]
    return users[-1]


def image_paths() -> dict[str, Path]:
    """Destination -> source of the runtime stage's COPY instructions (what the image ships, by path)."""
    runtime = dockerfile_stages()[-1]
    out: dict[str, Path] = {}
    for word, args in runtime.steps:
        if word == "COPY":
            *sources, dest = [a for a in shlex.split(args) if not a.startswith("--")]
            out[dest] = Path(sources[0])
    return out
