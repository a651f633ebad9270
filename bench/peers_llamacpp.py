"""llama-cpp-python's side of bench/peers.py: the batch-1 rows on the Q4_1 GGUF, with and without a GGUF LoRA.

Runs inside bench/.work/llamacpp (its own virtualenv, llama-cpp-python built from source), started by
bench/peers.py once per thread count as

    bench/.work/llamacpp/bin/python bench/peers_llamacpp.py SPEC.json

SPEC holds the GGUF, the LoRA converted to GGUF (or null), the thread count, the rows (batch 1 only), the run
count and whether llama.cpp may use its extra buffer types (weight repacking, AMX); the last stdout line is one JSON
object. Decoding is greedy through ``Llama.generate`` (which never stops
at EOS by itself), cut at exactly ``NEW_TOKENS`` sampled tokens; ``reset()`` before each request so that no prompt
is served from the previous request's KV cache. A LoRA is applied at load in llama.cpp, so the LoRA row gets its
own ``Llama``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_workload import NEW_TOKENS, Row, peak_rss_bytes, prompt, summarise


def generate(llm: Any, text: str) -> list[int]:
    """Greedy token ids for ``text``, ``NEW_TOKENS`` of them."""
    ids = llm.tokenize(text.encode(), add_bos=True, special=False)
    llm.reset()
    out: list[int] = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == NEW_TOKENS:
            break
    return out


def run_row(llm: Any, row: Row, runs: int) -> dict[str, Any]:
    if row.requests != 1:
        raise SystemExit(f"llama.cpp runs batch 1 only, row {row.key} has {row.requests} requests")
    walls = []
    for run in range(runs + 1):  # run 0 warms up
        t = time.perf_counter()
        ids = generate(llm, prompt(0))
        wall = time.perf_counter() - t
        if len(ids) != NEW_TOKENS:
            raise SystemExit(f"llama.cpp {row.key}: {len(ids)} tokens, expected {NEW_TOKENS}")
        if run:
            walls.append(wall)
    return summarise(walls, NEW_TOKENS, ids)


def without_extra_buffers(llama_cpp: Any) -> None:
    """Make every ``Llama`` load with ``use_extra_bufts = False`` (no CPU repack / AMX buffer types): the wrapper
    has no argument for it, so the default model parameters it starts from (``llama_cpp.llama_cpp``, the module
    ``Llama`` calls) are patched."""
    low_level = llama_cpp.llama_cpp
    default = low_level.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    low_level.llama_model_default_params = params


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    import llama_cpp

    if not spec["extra_bufts"]:
        without_extra_buffers(llama_cpp)
    threads = spec["threads"]
    results: dict[str, Any] = {}
    load_s: dict[str, float] = {}
    for raw in spec["rows"]:
        row = Row(**raw)
        lora = spec["lora_gguf"] if row.adapters else None
        if row.adapters and lora is None:
            print(f"llama.cpp {row.key} skipped: no LoRA GGUF", file=sys.stderr)
            continue
        start = time.perf_counter()
        llm = llama_cpp.Llama(
            model_path=spec["gguf"],
            lora_path=lora,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=spec["n_ctx"],
            seed=0,
            verbose=False,
        )
        load_s[row.key] = time.perf_counter() - start
        results[row.key] = run_row(llm, row, spec["runs"])
        print(f"llama.cpp t={threads} {row.key}: {results[row.key]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        llm.close()
        del llm
    print(
        json.dumps(
            {
                "rows": results,
                "load_s": load_s,
                "peak_rss_bytes": peak_rss_bytes(),
                "threads": threads,
                "extra_bufts": spec["extra_bufts"],
                "version": llama_cpp.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
