"""The load benchmark must not rot: its --quick mode runs every method once on a tiny checkpoint and checks
that the numbers are sane (it asserts that itself; this only runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT


@pytest.mark.slow
def test_load_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "load-quick.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "load.py"), "--quick", "--out", str(out), "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    (case,) = results["cases"]
    assert set(case["methods"]) == {
        "stream",
        "ours-mmap",
        "ours-eager",
        "load_file",
        "load_file-pread",
        "transformers",
        "bound",
    }
    assert case["cache"] == "cold" and case["methods"]["stream"]["resident_before_max"] < 0.5
