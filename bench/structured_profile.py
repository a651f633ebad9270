"""Where a constrained decode step's time goes: 32 rows in process, free or each with its own JSON schema.

    .venv/bin/python bench/structured_profile.py constrained     # or: free

Builds the server's parts (``service.bootstrap``, the default model), runs two warm-up batches of 32 greedy rows
(64 tokens each, EOS ignored, the schemas of ``bench/structured_workload.py``), then three measured ones; prints the
median step time of each and a ``cProfile`` of the last, sorted by cumulative time, for the engine's own modules,
and the mean mask-fill and mask-wait times from the metrics. The figures are in bench/README.md (structured
output: serving).
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_workload import prompt, schema

from service import bootstrap, metrics
from service.config import Settings
from service.constraints.spec import Constraint
from service.engine.request import GenerationRequest, TokenEvent
from service.engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    constrained = sys.argv[1:] == ["constrained"]
    parts = bootstrap.build(Settings(model=ROOT / "models/SmolLM2-135M-Instruct", max_batch_size=32))
    engine, tokenizer = parts.engine, parts.tokenizer

    def batch(salt: str) -> list[float]:
        events: dict[str, list[TokenEvent]] = {}
        for i in range(32):
            grammar = (
                parts.grammars.get(Constraint("json_schema", json.dumps(schema(i, salt)))) if constrained else None
            )
            ids = tuple(tokenizer.encode(prompt(i)))
            request = GenerationRequest(f"r{i}", ids, 64, SamplingParams(), ignore_eos=True, grammar=grammar)
            events[request.request_id] = []
            engine.submit(request, events[request.request_id].append)
        steps = []
        while not all(e and e[-1].finish for e in events.values()):
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        return steps

    for k in range(2):
        batch(f"warm{k}")
    profile = cProfile.Profile()
    medians = []
    for k in range(3):
        if k == 2:
            profile.enable()
        medians.append(statistics.median(batch(f"run{k}")[5:]))  # past the prefill
        if k == 2:
            profile.disable()
    print("constrained" if constrained else "free", "median step ms:", [round(m * 1e3, 1) for m in medians])
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumtime").print_stats("service/(engine|constraints)", 20)
    print(out.getvalue())
    for histogram in (metrics.CONSTRAINT_MASK_SECONDS, metrics.CONSTRAINT_MASK_WAIT_SECONDS):
        samples = {s.name: s.value for s in next(iter(histogram.collect())).samples}
        count = next(v for k, v in samples.items() if k.endswith("_count"))
        total = next(v for k, v in samples.items() if k.endswith("_sum"))
        print(f"{histogram._name}: mean {total / max(count, 1) * 1e3:.3f} ms over {count:.0f} steps")


if __name__ == "__main__":
    main()
