"""bench/structured.py must not rot: its loraplex side runs on a tiny served model over real gRPC (4 streams, 2
LoRAs, one run), and its workload keeps the property the throughput ratio relies on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from structured_workload import LONG_ITEMS, NEW_TOKENS, schema, typical_schema


def test_constrained_rows_cannot_complete_within_the_token_budget() -> None:
    s = schema(3, "r1")
    assert s["properties"]["r1readings3"]["minItems"] == LONG_ITEMS > NEW_TOKENS  # one token per item at least
    assert schema(3, "r1") != schema(3, "r2") and schema(3, "r1") != schema(4, "r1")  # new per run and per stream
    assert len(typical_schema(0, 50)["properties"]) == 50


def test_the_bench_runs_on_a_tiny_model(served_tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    args = ["--model", str(served_tiny_dir), "--engines", "loraplex", "--streams", "4", "--adapters", "2"]
    args += [
        "--runs",
        "1",
        "--ttft-samples",
        "1",
        "--validity-schemas",
        "2",
        "--work",
        str(tmp_path),
        "--out",
        str(out),
    ]
    subprocess.run([sys.executable, str(ROOT / "bench/structured.py"), *args], check=True, timeout=600, cwd=ROOT)
    result = json.loads(out.read_text())
    ours = result["loraplex"]
    assert ours["free_tok_s"] > 0 and ours["constrained_tok_s"] > 0 and ours["ttft_ratio"] > 0
    assert ours["validity"]["valid"] == ours["validity"]["finished"]  # every output that finished validates
    assert result["compile"]["typical_compile_ms"]["median"] > 0
