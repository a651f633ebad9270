"""bench/prompt_lookup.py must not rot: a short run on the tiny served model reports every mode at each batch size,
and every drafted output equals plain greedy's (float32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.paths import ROOT


def test_the_prompt_lookup_bench_runs_every_mode_per_batch_size(served_tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lookup.json"
    cmd = [sys.executable, "bench/prompt_lookup.py", "--model", str(served_tiny_dir), "--batch", "1", "2",
           "--workload", "copy", "chat", "--runs", "2", "--max-new", "12", "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    seen = {(r["workload"], r["batch"], r["mode"]) for r in results}
    modes = ("plain", "lookup", "auto", "governed")
    assert seen == {(w, b, m) for w in ("copy", "chat") for b in (1, 2) for m in modes}
    for r in results:
        done, total = (int(x) for x in r["identical"].split("/"))
        assert done == total and total >= 3  # the workload's prompts, cycled to fill whole chunks
        assert r["decode_tok_s_median"] > 0 and len(r["decode_tok_s_runs"]) == 2
    plain = [r for r in results if r["mode"] == "plain"]
    assert all(r["accepted_per_token"] == 0 and r["speed_up"] == 1.0 for r in plain)  # no drafter, nothing accepted
