"""bench/grammar_engines.py must not rot: its smoke mode runs llguidance (the server's engine, in this venv, no peer
venv) on a few schemas with SmolLM2's real tokenizer, and every figure the table reads must be there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT


@pytest.mark.slow  # the real tokenizer (make model); ~7 s on a quiet machine
def test_quick_run_with_llguidance_only(tmp_path: Path, smollm2_dir: Path) -> None:
    out = tmp_path / "grammar.json"
    cmd = [sys.executable, str(ROOT / "bench/grammar_engines.py"), "--quick", "--here", "--engines", "llguidance"]
    cmd += ["--tokenizer", str(smollm2_dir / "tokenizer.json"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results["engines"]) == {"llguidance"}
    llg = results["engines"]["llguidance"]
    assert "failed" not in llg, llg["failed"]
    assert llg["setup_s"] > 0 and llg["versions"]["llguidance"]
    assert len(llg["compile"]["per_schema_ms"]) == 4 and not llg["compile"]["errors"]
    assert llg["compile"]["props50_ms"] > 0 and llg["compile"]["cache_hit_ms"]["n"] == 4
    # every valid instance walked token by token, alone and as one batch of 4 rows
    for walk in ("walk_1_row_first", "walk_1_row_second", "walk_props50"):
        assert llg[walk]["rejected"] == {} and llg[walk]["mask_ms"]["n"] > 10
    assert llg["walk_batch_first"]["rows"] == 4 and llg["walk_batch_first"]["rejected"] == {}
    assert llg["walk_batch_first"]["step_ms_all_rows"]["n"] > 10
    counts = llg["correctness"]["counts"]
    assert counts["schemas"] == 6 and counts["walks"] == 6 and counts["invalid"] == 0 and counts["dead_end"] == 0
    assert counts["valid"] + counts["capped"] == 6 and counts["instance_rejected"] == 0
    assert "| compile, 50 properties: ms |" in proc.stdout and "| llguidance |" in proc.stdout
