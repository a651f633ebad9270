"""The adapter-variants benchmark must not rot: its --quick mode serves LoRA, DoRA, a scale and a mixture on the
real SmolLM2; this checks the report's shape (never a duration)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT


@pytest.mark.slow
def test_variants_benchmark_quick(tmp_path: Path, smollm2_dir: Path) -> None:
    out = tmp_path / "variants.json"
    cmd = [sys.executable, str(ROOT / "bench" / "adapters_variants.py"), "--quick", "--out", str(out)]
    cmd += ["--work", str(tmp_path / "adapters"), "--model", str(smollm2_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {"base", "lora", "dora", "lora x0.5", "mix of 3"}
    for case in report["cases"].values():
        assert case["tok_s"] > 0 and len(case["runs"]) == 1
    assert report["cases"]["lora"]["cost_vs_lora"] == 1.0
