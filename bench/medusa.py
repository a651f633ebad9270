"""Medusa speculation vs plain greedy decoding in the serving engine: decode tok/s, tokens per step, identity.

    .venv/bin/python bench/medusa.py [--model models/SmolLM2-135M-Instruct] [--heads adapters/demo/medusa]
        [--dtype float32 bfloat16] [--batch 1 4 16] [--prompts 16] [--max-new 128] [--trees chain TREE ..]
        [--speculate-max-batch 4] [--draft-threshold 0] [--threads 0] [--json OUT]
        [--gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --dtype float32]

The same held-out chat prompts (none of them is a training prompt of ``scripts/train_medusa_heads.py``) go through
the engine in this process (``service.engine.Engine``: scheduler, speculative verification, detokenization;
no gRPC), in chunks of ``batch`` concurrent requests, once without heads (plain) and once per draft tree with
the heads registered as an adapter; the runs of a chunk alternate in order so that other load on the machine hits
all alike. Decode tok/s counts each request's tokens after its first over the chunk's time from its first token
to its last (the prefill is excluded); tokens per step = (tokens after the first) / (decode steps), from the
accepted-draft counts the engine reports. Every output is compared with plain greedy (rows identical / rows):
in float32 they must all be; in bfloat16 a verification pass computes a position's logits with other matrix
shapes than a one-token step, and where the two best logits are closer than bf16 rounding the argmax may differ
(as it may between two batch compositions), so a few rows can diverge after such a near-tie. Where the batch is
larger than ``--speculate-max-batch`` the engine switches speculation off, as the server does; a ``forced`` run
there turns it on, to show why it is off. The tree runs speculate at every step; the ``auto`` run is the server's
default, where ``service.engine.governor`` measures both kinds of step and keeps the faster (with the last tree).
``--gguf`` serves that GGUF's weights with the model folder's config (float32: the Q4 blocks on the compiled kernels,
what ``--dtype auto`` serves where they load).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_medusa_heads import HELD_OUT_PROMPTS  # noqa: E402

from service.adapters.catalog import AdapterCatalog  # noqa: E402
from service.adapters.lora.part import LoraPart  # noqa: E402
from service.adapters.lora.store import AdapterStore  # noqa: E402
from service.adapters.medusa.part import MedusaPart  # noqa: E402
from service.adapters.medusa.registry import MedusaRegistry  # noqa: E402
from service.bootstrap import WEIGHT_FORMATS  # noqa: E402
from service.config import Settings  # noqa: E402
from service.engine.engine import Engine  # noqa: E402
from service.engine.request import GenerationRequest  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--heads", type=Path, default=ROOT / "adapters" / "demo" / "medusa")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--trees", nargs="+", default=["chain", DEFAULT_TREE], help="draft trees to compare")
    ap.add_argument("--speculate-max-batch", type=int, default=Settings().speculate_max_batch)
    ap.add_argument("--draft-threshold", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--gguf", type=Path, default=None, help="serve this GGUF's weights (the model folder's config)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.prompts > len(HELD_OUT_PROMPTS):
        raise SystemExit(f"--prompts {args.prompts}: only {len(HELD_OUT_PROMPTS)} prompts are defined")
    tok = Tokenizer.from_folder(args.model)
    prompts = [tuple(tok.encode_chat([{"role": "user", "content": p}])) for p in HELD_OUT_PROMPTS[: args.prompts]]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, heads {args.heads}")
    print(f"{len(prompts)} prompts x {args.max_new} new tokens, speculation off above batch {args.speculate_max_batch}")
    print(f"{'dtype':>8} {'batch':>5} {'tree':>6} {'plain tok/s':>11} {'medusa tok/s':>12} {'speed-up':>8} "
          f"{'tokens/step':>11} {'identical':>9}")  # fmt: skip
    results = []
    plain_by_batch: dict[tuple[str, str], list[list[int]]] = {}  # plain outputs at the first batch size
    for dtype in args.dtype:
        load = WEIGHT_FORMATS["folder" if args.gguf is None else "gguf"]
        model = load(Settings(model=args.model, gguf=args.gguf), getattr(torch, dtype), torch.device("cpu"))[0]
        for batch in args.batch:
            forced = batch > args.speculate_max_batch
            engines = {}
            for t, tree in enumerate(args.trees):
                smb = batch if forced else args.speculate_max_batch
                engines[f"t{t}"] = make_engine(model, tok, args, batch, tree, smb, adaptive=False)
            if forced:  # the server's behaviour: speculation off at this batch size
                engines["off"] = make_engine(model, tok, args, batch, "chain", args.speculate_max_batch)
            else:  # the server's default: the governor picks plain or speculative steps (with the last tree)
                engines["auto"] = make_engine(model, tok, args, batch, args.trees[-1], args.speculate_max_batch)
            for eng in engines.values():
                run_chunk(eng, prompts[:batch], 8, "medusa")  # warm-up
            runs: dict[str, Run] = {name: Run() for name in ["plain", *engines]}
            for i, start in enumerate(range(0, len(prompts), batch)):
                chunk = prompts[start : start + batch]
                order = ["plain", *engines]
                for name in order if i % 2 == 0 else order[::-1]:
                    eng = engines["t0"] if name == "plain" else engines[name]
                    runs[name].add(run_chunk(eng, chunk, args.max_new, None if name == "plain" else "medusa"))
            for eng in engines.values():
                eng.stop()
            plain = runs.pop("plain")
            reference = plain_by_batch.setdefault((dtype, "first"), plain.tokens)
            same_as_first_batch = sum(a == b for a, b in zip(plain.tokens, reference, strict=True))
            for name, run in runs.items():
                label = name if name in ("off", "auto") else args.trees[int(name[1:])]
                row = {
                    "dtype": dtype,
                    "batch": batch,
                    "tree": label,
                    "forced": forced and name != "off",
                    "plain_tok_s": round(plain.tok_s, 2),
                    "medusa_tok_s": round(run.tok_s, 2),
                    "speedup": round(run.tok_s / plain.tok_s, 3),
                    "tokens_per_step": round(run.tokens_per_step, 3),
                    "identical": run.tokens == plain.tokens,
                    "identical_rows": sum(a == b for a, b in zip(run.tokens, plain.tokens, strict=True)),
                    "rows": len(plain.tokens),
                    "plain_rows_identical_to_first_batch_size": same_as_first_batch,
                }
                results.append(row)
                shown = label if label in ("chain", "off", "auto") else f"{len(label.split(';'))}n"
                shown += "*" if row["forced"] else ""
                print(f"{dtype:>8} {batch:>5} {shown:>6} {plain.tok_s:>11.1f} {run.tok_s:>12.1f} "
                      f"{row['speedup']:>7.2f}x {run.tokens_per_step:>11.2f} "
                      f"{row['identical_rows']:>4}/{row['rows']:<4} (plain vs plain at batch {args.batch[0]}: "
                      f"{same_as_first_batch}/{row['rows']})", flush=True)  # fmt: skip
        del model
    if args.json is not None:
        meta = {
            "threads": torch.get_num_threads(),
            "prompts": len(prompts),
            "max_new": args.max_new,
            "heads": str(args.heads),
            "trees": args.trees,
            "speculate_max_batch": args.speculate_max_batch,
            "draft_threshold": args.draft_threshold,
            "gguf": None if args.gguf is None else args.gguf.name,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


DEFAULT_TREE = "0;1;2;3;0.0;0.1;0.2;1.0;0.0.0"  # scripts/design_medusa_tree.py, 9 nodes, for the demo heads


def make_engine(
    model: Any, tok: Tokenizer, args: argparse.Namespace, batch: int, tree: str, smb: int, *, adaptive: bool = True
) -> Engine:
    settings = Settings(
        model=args.model,
        max_batch_size=batch,
        max_total_tokens=1024,
        max_prompt_tokens=512,
        speculate_max_batch=smb,
        speculate_tree=tree,
        speculate_adaptive=adaptive,
        draft_threshold=args.draft_threshold,
        prefix_cache_bytes=0,  # every run prefills alike
    )
    cfg = model.cfg
    store = AdapterStore(cfg, device=model.device, dtype=model.dtype, device_budget_bytes=1 << 26,
                         host_budget_bytes=1 << 26)  # fmt: skip
    medusa = MedusaRegistry(cfg, device=model.device, dtype=model.dtype)
    catalog = AdapterCatalog([MedusaPart(medusa, tree=tree, threshold=args.draft_threshold), LoraPart(store)])
    medusa.register("medusa", args.heads)
    engine = Engine(model, tok, settings, adapters=catalog)
    engine.start()
    return engine


@dataclass
class Run:
    tokens: list[list[int]] = field(default_factory=list)
    decode_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0

    def add(self, part: tuple[list[list[int]], int, int, float]) -> None:
        tokens, decode_tokens, steps, seconds = part
        self.tokens += tokens
        self.decode_tokens += decode_tokens
        self.steps += steps
        self.seconds += seconds

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.decode_tokens / self.steps if self.steps else 0.0


def submit_all(engine: Engine, requests: list[GenerationRequest]) -> list[list[tuple[float, Any]]]:
    """Submit every request at once and wait until all have finished: each one's events with their arrival times."""
    done = threading.Semaphore(0)
    events: list[list[tuple[float, Any]]] = [[] for _ in requests]
    for i, request in enumerate(requests):

        def sink(e: Any, i: int = i) -> None:
            events[i].append((time.perf_counter(), e))
            if e.finish is not None:
                done.release()

        engine.submit(request, sink)
    for _ in requests:
        if not done.acquire(timeout=600):
            raise TimeoutError("a request did not finish")
    return events


def run_chunk(
    engine: Engine, prompts: list[tuple[int, ...]], max_new: int, adapter: str | None
) -> tuple[list[list[int]], int, int, float]:
    """All prompts at once; (tokens per prompt, decode tokens, decode steps, first token -> last token seconds)."""
    requests = [
        GenerationRequest(request_id=f"r{i}", prompt_ids=p, max_new_tokens=max_new, adapter_id=adapter)
        for i, p in enumerate(prompts)
    ]
    events = submit_all(engine, requests)
    tokens = [[t for _, e in ev for t in e.token_ids] for ev in events]
    first = min(ev[0][0] for ev in events)
    last = max(ev[-1][0] for ev in events)
    decode_tokens = sum(len(t) - 1 for t in tokens)
    steps = decode_tokens - sum(ev[-1][1].accepted_draft_tokens for ev in events)
    return tokens, decode_tokens, steps, last - first


if __name__ == "__main__":
    main()
