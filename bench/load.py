"""Benchmark: loading a model's weights into their serving layout, streamed loader vs the alternatives.

End state for every method: the parameters of ``service.model.llama.Llama`` (fused ``wqkv`` and ``w13`` per
layer, o/down/norms/embedding, tied ``lm_head`` not duplicated) in the target dtype, filled through the plan
of ``service.model.load_folder.build_load_plan`` — except ``transformers``, whose end state is its own usable
``AutoModelForCausalLM`` (time to a usable model). Methods, each in its own fresh process:

    stream         load_tensors(mode="stream")  (ours)
    ours-mmap      load_tensors(mode="mmap")    (safe_open + copy, our comparison mode)
    ours-eager     load_tensors(mode="eager")   (read file into bytes + safetensors.torch.load + copy)
    load_file      safetensors.torch.load_file (mmap) per file, then assemble: param views .copy_(tensor)
    load_file-pread  the same with load_file(..., backend="pread")
    transformers   AutoModelForCausalLM.from_pretrained(folder, dtype=...), then one read per memory page of
                   every parameter: transformers 5 may hand back parameters still backed by the file's mmap,
                   whose reads would otherwise land in the first forward pass (from_pretrained alone is
                   recorded too, as stage ``from_pretrained_seconds``)
    bound          cold: a plain sequential read of the same files after eviction (like ``cat``);
                   warm: the same bytes read into pre-faulted memory (the copy alone)

Timing starts after imports and ends when the end state is reached (allocation, config and header parsing
included). Cold runs evict every file from the page cache (``POSIX_FADV_DONTNEED``) in the child just before
its timer starts and check with ``mincore`` that nothing stayed resident. Methods alternate A B C A B C ...,
one warm-up round first, medians of ``--runs`` rounds with min and max; ratios are taken per round against
``stream`` and their median reported. Peak RSS is the child's ``ru_maxrss``; ``baseline`` is a child that
imports what ``stream`` imports and allocates nothing.

    .venv/bin/python bench/load.py            # full: SmolLM2 + a 2.2 GB synthetic checkpoint, ~10 min
    .venv/bin/python bench/load.py --quick    # tiny synthetic checkpoint, 1 run each, asserts sanity
    python3 bench/load.py --device cuda --only synthetic --runs 3   # into GPU memory (scripts/gpu_check.sh)

``--device cuda``: every method ends with the parameters on the GPU (``stream`` through its reused pinned staging
buffers, the others by copying what they loaded; ``transformers`` with ``.to(device)``), timed until the device
has finished its copies; the bound still reads into host memory, and the peak of GPU memory is recorded. Results go
to ``bench/results/load-cuda.json`` and their own section of ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work"
RESULTS = ROOT / "bench" / "results"
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
METHODS = ("stream", "ours-mmap", "ours-eager", "load_file", "load_file-pread", "transformers")

# TinyLlama-1.1B's shape (untied head): 2.2 GB in bf16, in 4 shards.
SYNTH_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "bfloat16",
}
QUICK_CONFIG = {**SYNTH_CONFIG, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4}
QUICK_CONFIG.update({"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096})


# ----------------------------------------------------------------------------------------------- page cache


def evict(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages (a checkpoint just written) are not dropped by DONTNEED
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(files: list[Path]) -> float:
    """Fraction of the files' pages in the page cache, by mincore(2) on a fresh mapping (touches nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = total = 0
    for f in files:
        size = f.stat().st_size
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            ok = libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
            libc.munmap(ctypes.c_void_p(addr), size)
            if not ok:
                return float("nan")
            resident += sum(b & 1 for b in vec)
            total += pages
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def warm_up(files: list[Path]) -> None:
    buf = bytearray(16 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# --------------------------------------------------------------------------------------------- checkpoints


def write_synthetic(folder: Path, config: dict[str, Any], shard_bytes: int) -> Path:
    """A Llama-shaped bf16 checkpoint, sharded with an index, filled with (cheap) random values."""
    import torch
    from safetensors.torch import save_file

    marker = folder / "complete.json"
    if marker.is_file() and json.loads(marker.read_text()) == config:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (nh * d, h)),
            (p + "self_attn.k_proj.weight", (nkv * d, h)),
            (p + "self_attn.v_proj.weight", (nkv * d, h)),
            (p + "self_attn.o_proj.weight", (h, nh * d)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    pool = (torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        n = 2 * _numel(shape)
        if size and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += n
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for k, (name, shape) in enumerate(group):
            t = torch.empty(_numel(shape), dtype=torch.bfloat16)  # [numel]
            for lo in range(0, t.numel(), pool.numel()):  # tile the pool, shifted per tensor
                n = min(pool.numel(), t.numel() - lo)
                t[lo : lo + n] = pool.roll(k * 7919 + lo)[:n]
            tensors[name] = t.view(shape)
            weight_map[name] = shard
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    total = sum(2 * _numel(s) for _, s in shapes)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    marker.write_text(json.dumps(config))
    return folder


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def private_copy(src: Path, dst: Path) -> Path:
    """A copy nobody else maps, so that eviction works (pages mapped by another process stay resident)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        s, d = src / name, dst / name
        if s.is_file() and (not d.is_file() or d.stat().st_size != s.stat().st_size):
            shutil.copyfile(s, d)
    return dst


def checkpoint_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


# ------------------------------------------------------------------------------------------------ children


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement in this fresh process; returns seconds, peak RSS and details."""
    method, folder, cold = spec["method"], Path(spec["folder"]), spec["cold"]
    files = checkpoint_files(folder)
    import safetensors.torch  # imported by every method before its timer, and by the baseline
    import torch

    from service.loading import CheckpointIndex, load_tensors
    from service.model.config import ModelConfig
    from service.model.llama import Llama
    from service.model.load_folder import build_load_plan

    dtype = getattr(torch, spec["dtype"])
    device = torch.device(spec.get("device", "cpu"))
    if device.type == "cuda":
        torch.cuda.init()  # the CUDA context before the timer, as a server has it before it loads
    if method == "baseline":
        return {"seconds": 0.0, "rss": _peak_rss()}
    if method == "transformers":
        import transformers

        transformers.logging.set_verbosity_error()
    out: dict[str, Any] = {}
    prefaulted = None
    if method == "bound" and not cold:
        total = sum(f.stat().st_size for f in files)
        prefaulted = torch.ones(total, dtype=torch.uint8)  # faulted in before the timer
    if cold:
        evict(files)
        out["resident_before"] = resident_fraction(files)
    t0 = time.perf_counter()
    if method == "bound":
        _bound(files, prefaulted)
    elif method == "transformers":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        model.eval()
        out["stats"] = {"from_pretrained_seconds": time.perf_counter() - t0}
        if device.type != "cpu":
            model.to(device)
        with torch.no_grad():
            for p in model.parameters():
                flat = p.detach().reshape(-1)  # [numel]
                flat[:: max(1, mmap.PAGESIZE // p.element_size())].sum()  # one element per page: resident
    else:
        cfg = ModelConfig.from_hf(folder)
        index = CheckpointIndex.open(folder)
        model = Llama(cfg, dtype=dtype, device=device)
        plan, ignore = build_load_plan(model)
        if method in ("stream", "ours-mmap", "ours-eager"):
            mode = "stream" if method == "stream" else method.removeprefix("ours-")
            if spec.get("profile"):
                out["profile"] = _instrument_stream()
            stats = load_tensors(index, plan, mode=mode, unexpected="error", ignore_unexpected=ignore)  # type: ignore[arg-type]
            out["stats"] = {k: getattr(stats, k) for k in ("header_seconds", "read_seconds", "convert_seconds")}
            out["stats"]["header_seconds"] += index.header_seconds
        else:
            backend = "pread" if method == "load_file-pread" else "mmap"
            with torch.no_grad():
                for f in index.files:
                    state = safetensors.torch.load_file(str(f), backend=backend)
                    for name, tensor in state.items():
                        if name in plan:
                            plan[name].copy_(tensor)
                    del state
        out["weights_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the copies are done, not just queued
        out["device_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    out["seconds"] = time.perf_counter() - t0
    out["rss"] = _peak_rss()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_seconds_process"] = usage.ru_utime + usage.ru_stime  # imports included
    return out


def _instrument_stream() -> dict[str, float]:
    """Wrap the streamed reader's two kernel-heavy steps to sum, over threads, their wall and CPU seconds:
    ``populate`` (fresh destination pages, MADV_POPULATE_WRITE) and ``preadv`` (page cache -> memory)."""
    import threading

    from service.loading import stream

    acc = {"populate_seconds": 0.0, "populate_cpu_seconds": 0.0, "preadv_seconds": 0.0, "preadv_cpu_seconds": 0.0}
    lock = threading.Lock()

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    acc[f"{name}_seconds"] += time.perf_counter() - t
                    acc[f"{name}_cpu_seconds"] += time.thread_time() - c

        return wrapper

    stream.populate = timed("populate", stream.populate)  # type: ignore[method-assign]
    stream.pread_into = timed("preadv", stream.pread_into)  # type: ignore[method-assign]
    return acc


def _bound(files: list[Path], dest: Any) -> None:
    """Cold: read every byte once into a small reused buffer (cat). Warm: into pre-faulted memory."""
    if dest is None:
        buf = memoryview(bytearray(16 << 20))
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while os.readv(fd, [buf]):
                pass
            os.close(fd)
        return
    view = dest.numpy().data
    at = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        size = os.fstat(fd).st_size
        off = 0
        while off < size:
            off += os.preadv(fd, [view[at + off : at + min(size, off + (16 << 20))]], off)
        at += size
        os.close(fd)


def _gpu_name(device: str) -> str:
    if not device.startswith("cuda"):
        return ""
    import torch

    return f", {torch.cuda.get_device_name(torch.device(device))}"


def _peak_rss() -> int:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


CHILD_ENV: dict[str, str] = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_child(spec: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **CHILD_ENV},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------------- driver


def measure_case(
    name: str, folder: Path, dtype: str, cold: bool, methods: tuple[str, ...], runs: int, warmup: bool, device: str
) -> dict[str, Any]:
    """One case's rounds, each method in a fresh child loading into ``device`` (the bound reads into host memory)."""
    files = checkpoint_files(folder)
    order = (*methods, "bound")
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in order}
    t_case = time.perf_counter()
    for r in range(-1 if warmup else 0, runs):
        for m in order if r % 2 == 0 else reversed(order):  # A B C ... then C B A: no method always first
            if not cold:
                warm_up(files)
            res = run_child({"method": m, "folder": str(folder), "dtype": dtype, "cold": cold, "device": device})
            if r >= 0:
                samples[m].append(res)
        print(f"  {name}: round {r + 1}/{runs} done ({time.perf_counter() - t_case:.0f} s)", flush=True)
    return summarize(name, folder, dtype, cold, samples)


def summarize(
    name: str, folder: Path, dtype: str, cold: bool, samples: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    def stats(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    files = checkpoint_files(folder)
    out: dict[str, Any] = {
        "case": name,
        "folder": str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else str(folder),
        "files": len(files),
        "file_bytes": sum(f.stat().st_size for f in files),
        "dtype": dtype,
        "cache": "cold" if cold else "warm",
        "runs": len(samples["stream"]),
        "methods": {},
    }
    stream_t = [s["seconds"] for s in samples["stream"]]
    for m, ss in samples.items():
        t = [s["seconds"] for s in ss]
        entry: dict[str, Any] = {"seconds": stats(t), "samples": t, "rss_bytes": stats([s["rss"] for s in ss])}
        if m != "stream":
            ratios = [a / b for a, b in zip(t, stream_t, strict=True)]
            entry["ratio_vs_stream"] = {"median": statistics.median(ratios), "per_pair": ratios}
        if "weights_bytes" in ss[0]:
            out["weights_bytes"] = ss[0]["weights_bytes"]
        if "stats" in ss[0]:
            entry["stages"] = {k: statistics.median(s["stats"][k] for s in ss) for k in ss[0]["stats"]}
        if "device_peak_bytes" in ss[0]:
            entry["device_peak_bytes"] = stats([s["device_peak_bytes"] for s in ss])
        if cold and "resident_before" in ss[0]:
            entry["resident_before_max"] = max(s["resident_before"] for s in ss)
        out["methods"][m] = entry
    out["bound_fraction"] = out["methods"]["bound"]["seconds"]["median"] / out["methods"]["stream"]["seconds"]["median"]
    return out


def render_readme_section(results: dict[str, Any], title: str = "Loading") -> str:
    mb = 1 << 20
    base = results["baseline_rss_bytes"]
    load_start, load_end = results.get("load_average_start", [0])[0], results.get("load_average_end", [0])[0]
    omp = results.get("omp_threads")
    lines = [
        f"### {title}",
        "",
        f"Command: `{results['command']}` — {results['date']}, {results['machine']}, 1-min load average"
        f" {load_start:.1f} at start, {load_end:.1f} at end"
        + (f", OMP_NUM_THREADS={omp} in every child" if omp else "")
        + f", {results.get('wall_seconds', 0) / 60:.0f} min.",
        "",
        "End state: the `Llama` parameters in serving layout (fused `wqkv`, `w13`; tied head not duplicated)",
        "in the target dtype, via `build_load_plan` (`transformers`: its own model, time to usable). Each run in a",
        "fresh process; methods alternate per round; medians (min–max) over the rounds; ratio = method / stream per",
        "round, median (> 1: stream faster). Cold = every file evicted (`POSIX_FADV_DONTNEED`, checked by mincore)",
        "right before the timer. Bound: cold = plain sequential read of the files (cat); warm = the same bytes read",
        "into pre-faulted memory. RSS: peak of the child; `+w` = (peak − baseline) / final weights bytes,",
        f"baseline (a child importing what `stream` imports) = {base / mb:.0f} MB.",
        "",
    ]
    lines += [
        "Goals (medians): stream ≥ 1.5× faster than `load_file` + assembling; cold stream ≥ 0.8 of the bound;",
        "stream peak RSS ≤ 1.1 × weights + baseline.",
        "",
        "| case | cache | vs load_file | vs pread | vs transformers | of bound | stream RSS − baseline / weights |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        ms, w = case["methods"], case.get("weights_bytes", 0)

        def ratio(m: str, ms: dict[str, Any] = ms) -> str:
            return f"{ms[m]['ratio_vs_stream']['median']:.2f}×" if m in ms else "–"

        over = (ms["stream"]["rss_bytes"]["median"] - base) / w if w else float("nan")
        lines.append(
            f"| {case['case']} → {case['dtype']} | {case['cache']} | {ratio('load_file')} | {ratio('load_file-pread')}"
            f" | {ratio('transformers')} | {case['bound_fraction']:.2f} | {over:.2f} |"
        )
    lines.append("")
    for case in results["cases"]:
        w = case.get("weights_bytes", 0)
        stages = case["methods"]["stream"].get("stages", {})
        lines += [
            f"**{case['case']}** — {case['file_bytes'] / mb:.0f} MB in {case['files']} file(s) → "
            f"{case['dtype']} ({w / mb:.0f} MB of weights), {case['cache']} cache, {case['runs']} runs. "
            f"Stream reaches **{case['bound_fraction']:.2f}** of the bound; its stages (median s): "
            + ", ".join(f"{k.removesuffix('_seconds')} {v:.3f}" for k, v in stages.items())
            + ".",
            "",
            "| method | seconds, median (min–max) | ratio vs stream | peak RSS MB | +w |",
            "|---|---|---|---|---|",
        ]
        for m, e in case["methods"].items():
            s = e["seconds"]
            r = f"{e['ratio_vs_stream']['median']:.2f}×" if "ratio_vs_stream" in e else "1"
            rss = e["rss_bytes"]["median"]
            plus = f"{(rss - base) / w:.2f}" if w and m != "bound" else ""
            lines.append(f"| {m} | {s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f}) | {r} | {rss / mb:.0f} | {plus} |")
        lines.append("")
    return "\n".join(lines)


def write_readme(section: str, key: str) -> None:
    """Replace (or append) this result file's block in bench/README.md, leaving everything else alone."""
    readme = ROOT / "bench" / "README.md"
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    text = readme.read_text() if readme.is_file() else "# Benchmarks\n\nSee /work/shared/BENCHMARKS.md for the rules.\n"
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    readme.write_text(text)


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    cases = results["cases"]
    fig, axes = plt.subplots(2, len(cases), figsize=(4.2 * len(cases), 6.5), squeeze=False)
    for col, case in enumerate(cases):
        names = [m for m in case["methods"] if m != "bound"]
        secs = [case["methods"][m]["seconds"]["median"] for m in names]
        rss = [case["methods"][m]["rss_bytes"]["median"] / (1 << 20) for m in names]
        colors = ["tab:green" if m == "stream" else "tab:gray" for m in names]
        ax = axes[0][col]
        ax.barh(names, secs, color=colors)
        ax.axvline(case["methods"]["bound"]["seconds"]["median"], color="tab:red", ls="--", label="bound")
        ax.set_title(f"{case['case']}\n{case['dtype']}, {case['cache']}", fontsize=9)
        ax.set_xlabel("seconds (median)")
        ax.invert_yaxis()
        ax.legend(fontsize=7)
        ax = axes[1][col]
        ax.barh(names, rss, color=colors)
        ax.axvline((results["baseline_rss_bytes"] + case.get("weights_bytes", 0)) / (1 << 20), color="tab:red", ls="--")
        ax.set_xlabel("peak RSS MB (line: baseline + weights)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny synthetic checkpoint, 1 run each, sanity asserts")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", action="append", default=[], help="run only cases whose label contains this")
    ap.add_argument("--methods", help="comma-separated subset of " + ",".join(METHODS))
    ap.add_argument("--profile", action="store_true", help="one instrumented stream run per case; print it")
    ap.add_argument("--omp-threads", type=int, help="OMP_NUM_THREADS for every child (default: torch's own)")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results/load.json)")
    ap.add_argument("--work", type=Path, default=WORK, help="where checkpoints are written (git-ignored)")
    ap.add_argument("--device", default="cpu", help="load into this device: cpu (default) or cuda[:N]")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    t_all = time.perf_counter()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    cases: list[tuple[str, Path, str, bool, tuple[str, ...]]] = []
    if args.quick:
        runs, warmup = 1, False
        quick = write_synthetic(work / "quick", QUICK_CONFIG, shard_bytes=8 << 20)
        cases = [("quick bf16", quick, "bfloat16", True, METHODS)]
    else:
        runs, warmup = args.runs, True
        print("preparing checkpoints ...", flush=True)
        smol = private_copy(SMOLLM2, work / "smollm2")
        synth = write_synthetic(work / "synth-1.1b", SYNTH_CONFIG, shard_bytes=600 << 20)
        cases = [
            ("SmolLM2-135M fp32 file", smol, "float32", False, METHODS),
            ("SmolLM2-135M fp32 file", smol, "bfloat16", False, METHODS),
            ("SmolLM2-135M fp32 file", smol, "float32", True, ("stream", "load_file", "load_file-pread")),
            ("synthetic 1.1B bf16 file", synth, "bfloat16", True, METHODS),
            ("synthetic 1.1B bf16 file", synth, "bfloat16", False, METHODS),
        ]
    if args.only:
        cases = [c for c in cases if any(o in f"{c[0]} {c[2]} {'cold' if c[3] else 'warm'}" for o in args.only)]
    if args.methods:
        keep = args.methods.split(",")
        cases = [(a, b, c, d, tuple(m for m in e if m in keep)) for a, b, c, d, e in cases]
    if args.omp_threads:
        CHILD_ENV["OMP_NUM_THREADS"] = str(args.omp_threads)
    if args.profile:
        for name, folder, dtype, cold, _ in cases:
            if not cold:
                warm_up(checkpoint_files(folder))
            res = run_child({"method": "stream", "folder": str(folder), "dtype": dtype, "cold": cold, "profile": True})
            prof = {k: round(v, 3) for k, v in {**res["stats"], **res["profile"]}.items()}
            print(f"{name} -> {dtype}, {'cold' if cold else 'warm'}: {res['seconds']:.3f} s total; {prof}")
        return
    baseline = [run_child({"method": "baseline", "folder": str(cases[0][1]), "dtype": "float32", "cold": False})]
    results: dict[str, Any] = {
        "command": " ".join([".venv/bin/python bench/load.py", *sys.argv[1:]]),
        "omp_threads": args.omp_threads,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Linux {platform.release()}" + _gpu_name(args.device),
        "device": args.device,
        "load_average_start": os.getloadavg(),
        "cases": [],
    }
    for name, folder, dtype, cold, methods in cases:
        print(f"{name} -> {dtype}, {'cold' if cold else 'warm'}", flush=True)
        results["cases"].append(measure_case(name, folder, dtype, cold, methods, runs, warmup, args.device))
    baseline.append(run_child({"method": "baseline", "folder": str(cases[0][1]), "dtype": "float32", "cold": False}))
    results["baseline_rss_bytes"] = statistics.median(b["rss"] for b in baseline)
    results["load_average_end"] = os.getloadavg()
    results["wall_seconds"] = time.perf_counter() - t_all

    print(render_readme_section(results))
    if args.quick:
        for case in results["cases"]:
            for m, e in case["methods"].items():
                assert 0 < e["seconds"]["median"] < 120, (case["case"], m, e)
                assert e["rss_bytes"]["median"] > results["baseline_rss_bytes"] * 0.5, (m, e)
            if case["cache"] == "cold":
                resident = case["methods"]["stream"]["resident_before_max"]
                assert resident < 0.5, f"eviction failed ({resident:.0%} still resident; --work on tmpfs?)"
        out = args.out or work / "load-quick.json"
        out.write_text(json.dumps(results, indent=1))
        print(f"quick benchmark OK -> {out}")
        return
    out = args.out or RESULTS / ("load.json" if args.device == "cpu" else "load-cuda.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    write_readme(
        render_readme_section(results, title="Loading" if out.stem == "load" else f"Loading, `{out.name}`"),
        out.stem,
    )
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.png')}, bench/README.md ({results['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
