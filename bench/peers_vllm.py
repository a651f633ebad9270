"""vLLM's side of bench/peers.py: the workload through vLLM's offline API (``vllm.LLM``, no server).

Runs inside bench/.work/vllm (its own virtualenv), started by bench/peers.py as

    bench/.work/vllm/bin/python bench/peers_vllm.py SPEC.json

with the environment of the best CPU configuration already set by the parent (single process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``; tcmalloc and torch's libgomp in ``LD_PRELOAD``). SPEC holds the model
folder, dtype, rows, adapter folders and run count; the last stdout line is one JSON object with a result per row,
the load time and the peak RSS. Every request must come back with exactly ``NEW_TOKENS`` tokens or the run fails:
a figure for fewer tokens would not be the same workload.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_workload import NEW_TOKENS, Row, peak_rss_bytes, prompt, summarise


def engine(spec: dict[str, Any], max_num_seqs: int, max_model_len: int) -> tuple[Any, list[Any]]:
    """``vllm.LLM`` over ``spec``'s model and dtype with its LoRAs enabled, and one ``LoRARequest`` per adapter
    folder (ids from 1): what every vLLM runner of bench/ starts from."""
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    adapters = [LoRARequest(f"lora{k:02d}", k + 1, path) for k, path in enumerate(spec["adapters"])]
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enable_lora=bool(adapters),
        max_loras=max(1, len(adapters)),
        max_cpu_loras=max(1, len(adapters)),
        max_lora_rank=spec["lora_rank"],
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        seed=0,
    )
    return llm, adapters


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    rows = [Row(**r) for r in spec["rows"]]
    start = time.perf_counter()
    llm, adapters = engine(spec, max(r.requests for r in rows), spec["max_model_len"])
    load_s = time.perf_counter() - start
    # no min_tokens: vLLM implements it by masking EOS, which would change the greedy path; ignore_eos alone
    # keeps going past an EOS that was picked, as the other engines do
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results: dict[str, Any] = {}
    for row in rows:
        prompts = [prompt(i) for i in range(row.requests)]
        loras: list[LoRARequest | None] | None = None
        if row.adapters:
            loras = [adapters[a] if (a := row.adapter_of(i)) is not None else None for i in range(row.requests)]
        walls = []
        for run in range(spec["runs"] + 1):  # run 0 warms up (and loads this row's adapters)
            t = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            wall = time.perf_counter() - t
            counts = [len(o.outputs[0].token_ids) for o in outs]
            if counts != [NEW_TOKENS] * row.requests:
                raise SystemExit(f"vLLM {row.key}: token counts {counts}, expected {NEW_TOKENS} each")
            if run:
                walls.append(wall)
        results[row.key] = summarise(walls, NEW_TOKENS * row.requests, list(outs[0].outputs[0].token_ids))
        print(f"vllm {spec['dtype']} {row.key}: {results[row.key]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    import vllm

    print(
        json.dumps({"rows": results, "load_s": load_s, "peak_rss_bytes": peak_rss_bytes(), "version": vllm.__version__})
    )


if __name__ == "__main__":
    main()
