"""The cold-start benchmark must not rot: its --quick mode serves a tiny curve over two real servers; this checks
the report's shape (never a duration)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT


@pytest.mark.slow
def test_coldstart_benchmark_quick(tmp_path: Path, smollm2_dir: Path) -> None:
    out = tmp_path / "coldstart.json"
    cmd = [sys.executable, str(ROOT / "bench" / "adapters_coldstart.py"), "--quick", "--out", str(out)]
    proc = subprocess.run([*cmd, "--model", str(smollm2_dir)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results["points"]) == {"2/zipf", "6/zipf"}
    for point in results["points"].values():
        for mode in ("tight", "resident"):
            assert set(point[mode]) == {"ttft_p50", "ttft_p99", "tok_s", "loads", "evictions", "disk_reads"}
            assert point[mode]["tok_s"]["median"] > 0
        assert set(point["ratio"]) == {"ttft_p50", "ttft_p99", "tok_s"}
    assert results["points"]["2/zipf"]["budget_bytes"]["tight"] == 2 * results["adapter_device_bytes"]
