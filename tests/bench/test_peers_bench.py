"""bench/peers.py must not rot: its --quick mode runs the loraplex side on a tiny served model over real gRPC, and
its configuration probing, skips and ratios are checked against the real ``loraplex serve --help``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from peers_loraplex import Config, missing_flags, serve_help
from peers_report import markdown, ratios
from peers_workload import NEW_TOKENS, ROWS


def test_config_parses_name_flags_and_dtype() -> None:
    config = Config.parse('bf16= --dtype bfloat16 --adapter-dir "/a b"')
    assert config == Config("bf16", ("--dtype", "bfloat16", "--adapter-dir", "/a b"))
    assert config.dtype() == "bfloat16"
    assert Config.parse("q=--dtype=float32 --quantize int4").dtype() == "float32"
    assert Config.parse("plain=").dtype() is None
    assert Config.parse("g=--gguf {gguf} --adapter-dir={model}/a").expanded({"gguf": "/m.gguf", "model": "/m"}) == [
        "--gguf",
        "/m.gguf",
        "--adapter-dir=/m/a",
    ]
    with pytest.raises(ValueError, match="NAME=FLAGS"):
        Config.parse("--dtype bfloat16")


def test_missing_flags_against_the_real_serve_help() -> None:
    help_text = serve_help()
    assert missing_flags(Config.parse("a=--dtype bfloat16 --max-batch-size=8"), help_text) == []
    # a prefix of a real flag is not that flag
    assert missing_flags(Config.parse("b=--dtype bfloat16 --max-batch 8 --no-such-flag"), help_text) == [
        "--max-batch",
        "--no-such-flag",
    ]


def _engine(rates: dict[str, float], ids: dict[str, list[int]] | None = None) -> dict[str, object]:
    rows = {k: {"tok_s": v, "first_ids": (ids or {}).get(k, [int(k == "b1_lora"), 2, 3])} for k, v in rates.items()}
    return {"rows": rows, "peak_rss_bytes": 100e6, "load_s": 1.0}


def test_ratios_pair_each_config_with_the_peer_of_its_dtype_and_llamacpp_at_batch_1() -> None:
    results = {
        "workload": {"model": "m", "rows": [r.as_dict() for r in ROWS[:3]], "runs": 3},
        "loraplex": {
            "fp32": {**_engine({"b1": 30.0, "b16_l8": 200.0}), "dtype": "float32"},
            "bf16": {**_engine({"b1": 60.0, "b16_l8": 300.0}), "dtype": "bfloat16"},
            "int4": {"skipped": "this loraplex serve has no --quantize"},
        },
        "vllm": {"float32": _engine({"b1": 40.0, "b16_l8": 100.0}), "bfloat16": {"skipped": "boom"}},
        "llamacpp": {
            "threads_2": {
                **_engine({"b1": 120.0, "b1_lora": 90.0}, {"b1": [0, 2, 9], "b1_lora": [0, 2, 9]}),
                "extra_bufts_crashed": True,
            }
        },
        "peer_env": {"OMP_WAIT_POLICY": "PASSIVE"},
    }
    got = ratios(results)
    assert got == {
        "fp32 / vLLM fp32": {"b1": 0.75, "b16_l8": 2.0},
        "fp32 / llama.cpp 2 thr": {"b1": 0.25},
        "bf16 / llama.cpp 2 thr": {"b1": 0.5},
    }
    table = markdown(results)
    assert "| 1 request, no LoRA | 30.0 | 60.0 | 40.0 | 120.0 |" in table
    assert "| fp32 / vLLM fp32 | 0.75 | – | 2.00 |" in table
    assert "- loraplex int4 skipped: this loraplex serve has no --quantize" in table
    assert "- vllm bfloat16 skipped: boom" in table
    assert "- llama.cpp threads_2: its default load crashed (SIGSEGV)" in table
    assert "peers ran with `OMP_WAIT_POLICY=PASSIVE`" in table
    # request 0's tokens against the first column (loraplex fp32, ids [0, 2, 3]): llama.cpp shares 2 of them; its
    # LoRA row repeated its base row's tokens, which the report calls out
    assert "| 1 request, no LoRA | 3 | 3 | 2 |" in table
    assert "- llama.cpp Q4_1 2 thr: the 1-LoRA row gave the base row's tokens" in table
    assert "- loraplex fp32: the 1-LoRA row" not in table


@pytest.mark.slow
def test_quick_run_on_a_tiny_model(tmp_path: Path, served_tiny_dir: Path) -> None:
    out = tmp_path / "peers.json"
    cmd = [sys.executable, str(ROOT / "bench/peers.py"), "--quick", "--engines", "loraplex"]
    cmd += ["--model", str(served_tiny_dir), "--work", str(tmp_path / "work"), "--out", str(out)]
    cmd += ["--loraplex-config", "fp32=--dtype float32", "--loraplex-config", "bogus=--no-such-flag 1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["loraplex"]["bogus"] == {"skipped": "this loraplex serve has no --no-such-flag"}
    fp32 = results["loraplex"]["fp32"]
    assert set(fp32["rows"]) == {"b1", "b16_l8"}
    assert fp32["rows"]["b16_l8"]["tokens"] == 16 * NEW_TOKENS
    assert all(len(r["tok_s_runs"]) == 1 and r["tok_s"] > 0 for r in fp32["rows"].values())
    assert fp32["peak_rss_bytes"] > 50e6 and fp32["ready_s"] > 0
    # the LoRAs the rows used are real PEFT folders on all seven projections
    (lora_dir,) = (tmp_path / "work/loras").iterdir()
    config = json.loads((lora_dir / "lora07/adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    table = out.with_suffix(".md").read_text()
    assert "| 16 requests over 8 LoRAs |" in table and "loraplex fp32" in table
