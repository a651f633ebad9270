"""vLLM's side of bench/structured.py: the same streams through vLLM's offline API, free and JSON-schema constrained.

Runs inside bench/.work/vllm (bench/peers_envs.py builds it), started by bench/structured.py as

    bench/.work/vllm/bin/python bench/structured_vllm.py SPEC.json

with the CPU environment bench/peers.py uses. SPEC holds the model folder, dtype, stream count, adapter folders
and run count; the last stdout line is one JSON object: tok/s per run for the free and the constrained batch (each
run's schemas new, so each constrained run compiles them), and the load time. Every request must return exactly
``NEW_TOKENS`` tokens, or the run fails.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_vllm import engine
from structured_workload import NEW_TOKENS, prompt, schema


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    streams = spec["streams"]
    start = time.perf_counter()
    llm, loras = engine(spec, streams, 512)
    load_s = time.perf_counter() - start
    prompts = [prompt(i) for i in range(streams)]
    per_stream = [loras[i % len(loras)] for i in range(streams)] if loras else None
    out: dict[str, Any] = {"free": [], "constrained": [], "load_s": load_s}
    for run in range(spec["runs"] + 1):  # run 0 warms up
        for kind in ("free", "constrained"):
            if kind == "free":
                params: Any = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
            else:
                params = [
                    SamplingParams(
                        temperature=0.0,
                        max_tokens=NEW_TOKENS,
                        ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(json=schema(i, f"r{run}")),
                    )
                    for i in range(streams)
                ]
            t = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=per_stream, use_tqdm=False)
            wall = time.perf_counter() - t
            counts = [len(o.outputs[0].token_ids) for o in outs]
            if counts != [NEW_TOKENS] * streams:
                raise RuntimeError(f"vllm {kind}: token counts {counts}, expected {NEW_TOKENS} each")
            if run:
                out[kind].append(streams * NEW_TOKENS / wall)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
