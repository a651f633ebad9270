"""scripts/gpu_check.sh (the prepared GPU run: gpu-marked tests + the load benchmark on CUDA) must not rot where no
GPU is: it is valid shell, finds the gpu-marked test files, and refuses with exit 2 where torch sees no device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.paths import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_the_script_is_valid_shell() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the script would run the checks")
def test_without_a_device_it_refuses_with_exit_2(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "torch sees no CUDA device" in proc.stderr
    assert not (tmp_path / "gpu-tests.txt").exists()  # nothing ran


def test_the_gpu_marked_files_it_collects_exist() -> None:
    marked = sorted(p for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())
    assert len(marked) >= 3  # the model, the loader's staging buffers, the adapter tiers
