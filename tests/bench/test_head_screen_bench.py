"""bench/head_screen.py must not rot: a short run on the default model's GGUF reports a row of the table, and checks
every screened result against the kernel's full product as it goes (a disagreement exits non-zero), below and past
the kernel's rows (past them the screen runs in chunks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.paths import ROOT


def test_the_head_screen_bench_runs_and_reports(smollm2_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "screen.json"
    cmd = [sys.executable, "bench/head_screen.py", "--rows", "8", "40", "--repeats", "3", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| 8 |" in run.stdout and "| 40 |" in run.stdout
    report = json.loads(out.read_text())
    assert [row["rows"] for row in report["results"]] == [8, 40]
    for row in report["results"]:
        assert row["full_ms"] > 0 and row["screened_ms"] > 0
        assert (row["candidates"] is not None) == report["screen"]  # screened rows counted where the CPU can screen
        assert row["candidates"] is None or 1 <= row["candidates"]["median"] <= row["candidates"]["max"] <= 256
