"""What a DoRA row, a per-request scale and a three-adapter mixture cost against a plain LoRA row, in one run.

    .venv/bin/python bench/adapters_variants.py            # ~4 min on 2 cores
    .venv/bin/python bench/adapters_variants.py --quick    # CI smoke: tiny counts

Work: SmolLM2-135M-Instruct fp32 in-process engine (built as the server builds it), adapters written by `peft`
(r=8 on all seven projections, random non-zero weights; the DoRA one with `use_dora=True` and a perturbed
magnitude) into bench/.work/variants. Each round runs ``--streams`` greedy requests of ``--new-tokens`` tokens
(EOS ignored), all admitted together, once per case: base only, LoRA, DoRA, LoRA at scale 0.5, a mixture of three
LoRAs (weights 0.5 / 0.3 / 0.2); cases alternate within a round and the report gives each case's decode tokens
per second and its ratio to the LoRA case (medians over ``--runs`` rounds). Goals (issue 23): DoRA <= 1.15x the
LoRA row's cost, the mixture <= 1.3x. Results: bench/results/adapters_variants.json.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from service.bootstrap import build
from service.config import Settings
from service.engine.request import GenerationRequest, TokenEvent

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work" / "variants"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "lora": {"use_dora": False, "seed": 1},
    "dora": {"use_dora": True, "seed": 2},
    "mix-a": {"use_dora": False, "seed": 3},
    "mix-b": {"use_dora": False, "seed": 4},
    "mix-c": {"use_dora": False, "seed": 5},
}
CASES: dict[str, tuple[tuple[str, float], ...]] = {
    "base": (),
    "lora": (("lora", 1.0),),
    "dora": (("dora", 1.0),),
    "lora x0.5": (("lora", 0.5),),
    "mix of 3": (("mix-a", 0.5), ("mix-b", 0.3), ("mix-c", 0.2)),
}


def write_adapters(model_dir: Path, r: int, work: Path) -> None:
    """The PEFT adapters of ``ADAPTERS`` under ``work`` (skipped where written already)."""
    if all((work / n / "adapter_model.safetensors").exists() for n in ADAPTERS):
        return
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for name, spec in ADAPTERS.items():
        config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=ALL, use_dora=spec["use_dora"])
        model = get_peft_model(base, config)
        gen = torch.Generator().manual_seed(spec["seed"])
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_magnitude_vector" in pname:
                    p.mul_(1 + 0.05 * torch.randn(p.shape, generator=gen))
                elif "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        model.save_pretrained(work / name)
        base = model.unload()


def request(rid: str, mix: tuple[tuple[str, float], ...], prompt: list[int], new_tokens: int) -> GenerationRequest:
    adapter = mix[0][0] if mix else None
    weighted = mix if len(mix) > 1 or (mix and mix[0][1] != 1.0) else ()
    return GenerationRequest(
        request_id=rid, prompt_ids=tuple(prompt), max_new_tokens=new_tokens, ignore_eos=True, adapter_id=adapter,
        mix=weighted,
    )  # fmt: skip


def one_round(engine: Any, mix: tuple[tuple[str, float], ...], streams: int, new_tokens: int) -> float:
    """Decode tokens per second of ``streams`` requests admitted together (first tokens, i.e. prefill, excluded)."""
    release, held = threading.Event(), threading.Event()

    def gate(_: TokenEvent) -> None:
        held.set()
        release.wait(10)

    engine.submit(GenerationRequest(request_id="gate", prompt_ids=(1, 2, 3), max_new_tokens=1), gate)
    held.wait(10)
    sinks: list[queue.SimpleQueue[tuple[float, TokenEvent]]] = []
    for i in range(streams):
        sink: queue.SimpleQueue[tuple[float, TokenEvent]] = queue.SimpleQueue()
        prompt = [(17 * i + 7 * j) % 5000 + 10 for j in range(24)]
        engine.submit(request(f"r{i}", mix, prompt, new_tokens), lambda e, q=sink: q.put((time.perf_counter(), e)))
        sinks.append(sink)
    release.set()
    first: list[float] = []  # when each request's first token arrived (its prefill done)
    last: list[float] = []
    for sink in sinks:
        at, event = sink.get(timeout=300)
        first.append(at)
        while event.finish is None:
            at, event = sink.get(timeout=300)
        if event.error is not None:
            raise RuntimeError(f"request failed: {event.error}")
        last.append(at)
    return streams * (new_tokens - 1) / (max(last) - max(first))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--work", type=Path, default=WORK, help="where the adapters are written")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "adapters_variants.json")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.new_tokens, args.runs = 4, 4, 1
    write_adapters(args.model, args.rank, args.work)
    s = Settings(model=args.model, dtype="float32", adapter_roots=(args.work,), max_batch_size=max(args.streams, 8))
    parts = build(s)
    for name in ADAPTERS:
        parts.adapters.register(name, args.work / name)
    engine = parts.engine
    engine.start()
    try:
        for mix in CASES.values():  # warm-up: every adapter loaded, every table laid out
            one_round(engine, mix, args.streams, max(args.new_tokens // 4, 2))
        rates: dict[str, list[float]] = {case: [] for case in CASES}
        for _ in range(args.runs):
            for case, mix in CASES.items():
                rates[case].append(one_round(engine, mix, args.streams, args.new_tokens))
    finally:
        engine.stop()
        parts.adapters.close()
    lora = statistics.median(rates["lora"])
    report = {
        "streams": args.streams,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "rank": args.rank,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "cases": {
            case: {"tok_s": statistics.median(r), "cost_vs_lora": lora / statistics.median(r), "runs": r}
            for case, r in rates.items()
        },
    }
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"| case | decode tok/s | cost per row vs LoRA | ({args.streams} streams, medians of {args.runs})")
    print("|---|---:|---:|")
    for case, row in report["cases"].items():
        print(f"| {case} | {row['tok_s']:.1f} | {row['cost_vs_lora']:.3f}x |")


if __name__ == "__main__":
    main()
