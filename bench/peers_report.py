"""bench/peers.py's results as ratios and a markdown table (figures, peak RSS, load time, ratios, token agreement,
skips).

Pure functions of the results dict that bench/peers.py writes; nothing here measures. A ratio is formed only between
figures of the same run: loraplex config / vLLM in the config's ``--dtype``, and loraplex config / llama.cpp for
the batch-1 rows, per llama.cpp thread count.
"""

from __future__ import annotations

from typing import Any

__all__ = ["agreement", "columns", "markdown", "ratios"]

DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _measured(d: Any) -> bool:
    return isinstance(d, dict) and "rows" in d


def columns(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(title, engine result) for every engine configuration that ran, in table order."""
    cols = [(f"loraplex {name}", d) for name, d in results.get("loraplex", {}).items() if _measured(d)]
    for dtype, d in results.get("vllm", {}).items():
        if _measured(d):
            cols.append((f"vLLM {DTYPE_SHORT.get(dtype, dtype)}", d))
    for key, d in results.get("llamacpp", {}).items():
        if _measured(d):
            cols.append((f"llama.cpp Q4_1 {key.removeprefix('threads_')} thr", d))
    return cols


def _tok_s(d: dict[str, Any], row: str) -> float | None:
    got = d["rows"].get(row)
    return float(got["tok_s"]) if got else None


def ratios(results: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """``{"<config> / vLLM <dtype>": {row: ratio}, "<config> / llama.cpp <t> thr": {row: ratio}}``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    vllm = results.get("vllm", {})
    llama = {k: d for k, d in results.get("llamacpp", {}).items() if _measured(d)}
    for name, ours in results.get("loraplex", {}).items():
        if not _measured(ours):
            continue
        peers: list[tuple[str, dict[str, Any]]] = []
        dtype = ours.get("dtype")
        if dtype and _measured(vllm.get(dtype)):
            peers.append((f"vLLM {DTYPE_SHORT.get(dtype, dtype)}", vllm[dtype]))
        peers += [(f"llama.cpp {k.removeprefix('threads_')} thr", d) for k, d in llama.items()]
        for title, peer in peers:
            per_row = {}
            for row in ours["rows"]:
                a, b = _tok_s(ours, row), _tok_s(peer, row)
                if a is not None and b:
                    per_row[row] = a / b
            if per_row:
                out.setdefault(f"{name} / {title}", {}).update(per_row)
    return out


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(results: dict[str, Any]) -> list[str]:
    """Markdown lines: per row, how many leading greedy tokens of request 0 each engine shares with the first
    column (same prompt and adapter everywhere: a check that the engines did the same work), and a note for each
    engine whose 1-LoRA row gave the base row's tokens (its LoRA had no visible effect)."""
    cols = [(t, d) for t, d in columns(results) if any("first_ids" in r for r in d["rows"].values())]
    if len(cols) < 2:
        return []
    ref_title, ref = cols[0]
    lines = ["", f"request 0's greedy tokens: leading tokens equal to {ref_title}'s (of 32)", ""]
    lines += ["| workload | " + " | ".join(t for t, _ in cols[1:]) + " |", "|---" * len(cols) + "|"]
    for row in results["workload"]["rows"]:
        base = ref["rows"].get(row["key"], {}).get("first_ids")
        cells = []
        for _, d in cols[1:]:
            ids = d["rows"].get(row["key"], {}).get("first_ids")
            cells.append("–" if base is None or ids is None else str(_prefix(base, ids)))
        lines.append(f"| {row['title']} | " + " | ".join(cells) + " |")
    for title, d in cols:
        b1, lora = d["rows"].get("b1", {}).get("first_ids"), d["rows"].get("b1_lora", {}).get("first_ids")
        if b1 is not None and b1 == lora:
            lines.append(f"- {title}: the 1-LoRA row gave the base row's tokens (the LoRA had no visible effect)")
    return lines


def _skips(results: dict[str, Any]) -> list[str]:
    notes = []
    for engine in ("loraplex", "vllm", "llamacpp"):
        section = results.get(engine, {})
        if isinstance(section, dict) and "skipped" in section:
            notes.append(f"- {engine} skipped: {section['skipped']}")
            continue
        for key, d in section.items() if isinstance(section, dict) else ():
            if isinstance(d, dict) and "skipped" in d:
                notes.append(f"- {engine} {key} skipped: {d['skipped']}")
        if isinstance(section, dict) and "lora_skipped" in section:
            notes.append(f"- {engine} LoRA row skipped: {section['lora_skipped']}")
    for key, d in results.get("llamacpp", {}).items():
        if isinstance(d, dict) and d.get("extra_bufts_crashed"):
            notes.append(f"- llama.cpp {key}: its default load crashed (SIGSEGV); measured without extra buffer types")
    return notes


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def _load_s(d: dict[str, Any]) -> float | None:
    got = d.get("ready_s", d.get("load_s"))
    if isinstance(got, dict):  # llama.cpp: one load per Llama; the base model's
        got = next(iter(got.values()), None)
    return None if got is None else float(got)


def markdown(results: dict[str, Any]) -> str:
    rows = results["workload"]["rows"]
    cols = columns(results)
    head = "| workload | " + " | ".join(t for t, _ in cols) + " |"
    lines = [f"tok/s, warm median of {results['workload']['runs']} (model {results['workload']['model']})", ""]
    lines += [head, "|---" * (len(cols) + 1) + "|"]
    for row in rows:
        lines.append(f"| {row['title']} | " + " | ".join(_fmt(_tok_s(d, row["key"])) for _, d in cols) + " |")
    rss = [_fmt(d["peak_rss_bytes"] / 1e6, ".0f") if d.get("peak_rss_bytes") else "–" for _, d in cols]
    lines.append("| peak RSS, MB | " + " | ".join(rss) + " |")
    lines.append("| start / load, s | " + " | ".join(_fmt(_load_s(d), ".1f") for _, d in cols) + " |")
    lines += ["", "start / load: loraplex from process start to health SERVING; vLLM the `LLM(...)` constructor;"]
    lines.append("llama.cpp the base model's `Llama(...)`. Peak RSS: VmHWM of the engine's process.")
    table = ratios(results)
    if table:
        titles = {r["key"]: r["title"] for r in rows}
        keys = [r["key"] for r in rows]
        lines += [
            "",
            "ratios (loraplex / peer, same run)",
            "",
            "| ratio | " + " | ".join(titles[k] for k in keys) + " |",
        ]
        lines.append("|---" * (len(keys) + 1) + "|")
        for name, per_row in table.items():
            lines.append(f"| {name} | " + " | ".join(_fmt(per_row.get(k), ".2f") for k in keys) + " |")
    lines += agreement(results)
    if notes := _skips(results):
        lines += ["", *notes]
    if env := results.get("peer_env"):
        lines += ["", "peers ran with " + ", ".join(f"`{k}={v}`" for k, v in env.items()) + " (--peer-env)"]
    m = results.get("machine", {})
    lines += ["", f"machine: {m.get('cpu')} x{m.get('cpus')}; load average before {m.get('load_avg_before')}, "
              f"after {m.get('load_avg_after')}"]  # fmt: skip
    return "\n".join(lines) + "\n"
