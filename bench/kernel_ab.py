"""Two builds of the native kernel library side by side in one process: a decode step of the real model on each,
with and without LoRA rows, the variants interleaved so that the machine's drift hits both alike.

    .venv/bin/python bench/kernel_ab.py --base-rev 8bdbc15 [--dtype bfloat16] [--weights folder|gguf] [--rows 32]
        [--adapters 16] [--rank 8] [--rounds 10]

``--base-rev`` builds the library of that commit (its ``service/`` from ``git archive``, compiled by its own
``service.kernels.native.build`` into a temporary cache); the other side is this checkout's. Each side loads its
own model (``WEIGHT_FORMATS``: ``folder`` keeps a bf16 model's projections in pairs where the CPU has bf16 dot
products; ``gguf`` the Q4_1 blocks, float32) and its own LoRA tables: ``--adapters`` random rank-``--rank``
adapters on all seven projections, row ``i`` on adapter ``i % N``, the batch built once (the engine's per-step
Python is the same on both sides). Reported per side: ms a step (best and median), LoRA / base throughput, and
whether both sides' logits are bit-identical (expected unless the change is numerical).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from adapters_math import random_adapters  # noqa: E402

from service.adapters.lora.batch import SITES, AdapterBatch, LoraTables  # noqa: E402
from service.bootstrap import WEIGHT_FORMATS  # noqa: E402
from service.config import Settings  # noqa: E402
from service.kernels import native  # noqa: E402
from service.model import KVCache  # noqa: E402
from service.platform import cpu_capability, cpu_flags  # noqa: E402

MODEL, GGUF = ROOT / "models/SmolLM2-135M-Instruct", ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"


def build_rev(rev: str, isa: str, work: Path) -> Path:
    """The library of commit ``rev``, built by that commit's own code."""
    src = work / "src"
    src.mkdir()
    archive = subprocess.run(["git", "archive", rev, "service"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    cache = str(work / "cache")
    code = (
        f"from pathlib import Path; from service.kernels import native; print(native.build({isa!r}, Path({cache!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=src, check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def side(
    lib: native.NativeKernels, args: argparse.Namespace, dtype: torch.dtype
) -> dict[str, Callable[[], torch.Tensor]]:
    """This library's model, cache and adapter batch: the base step and the LoRA step."""
    native._state.loaded, native._state.tried = lib, True  # the next load takes this library
    settings = Settings(model=MODEL, gguf=GGUF if args.weights == "gguf" else None)
    model, cfg, _ = WEIGHT_FORMATS[args.weights](settings, dtype, torch.device("cpu"))
    rows, ctx = args.rows, args.context
    cache = KVCache(cfg, rows, ctx + 2, dtype=dtype, device=model.device)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        prompt = torch.randint(0, cfg.vocab_size, (rows, ctx), generator=gen)
        model(prompt, torch.arange(ctx).expand(rows, ctx), cache, 0)
    nxt, pos = torch.randint(0, cfg.vocab_size, (rows, 1), generator=gen), torch.full((rows, 1), ctx)
    modules = tuple(m for ms in SITES.values() for m in ms)
    by_name = {f"a{i}": a for i, a in enumerate(random_adapters(cfg, args.adapters, (args.rank,), modules, dtype))}
    tables = LoraTables(cfg, device="cpu", dtype=dtype, native=model.lora_native)
    ids = [f"a{i % args.adapters}" for i in range(rows)]
    batch = AdapterBatch.build(ids, lambda a, layer: by_name[a].get(layer), tables)

    def step(adapters: AdapterBatch | None) -> torch.Tensor:
        with torch.inference_mode():
            hidden = model(nxt, pos, cache, 0, adapters=adapters, kv_len=ctx + 1)
            return model.logits(hidden[:, -1])

    return {"base": lambda: step(None), "lora": lambda: step(batch)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-rev", required=True, help="the commit whose library is side A")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--weights", default="folder", choices=["folder", "gguf"])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    isa = native.isa_for(cpu_capability(), cpu_flags())
    with tempfile.TemporaryDirectory() as tmp:
        libs = {
            args.base_rev: native.NativeKernels(build_rev(args.base_rev, isa, Path(tmp)), isa),
            "this checkout": native.NativeKernels(native.build(isa, native.default_cache_dir()), isa),
        }
        steps = {name: side(lib, args, dtype) for name, lib in libs.items()}
    logits = [s["lora"]() for s in steps.values()]
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, s in steps.items():
            for kind, fn in s.items():
                for _ in range(3):
                    start = time.perf_counter()
                    fn()
                    times.setdefault((name, kind), []).append(time.perf_counter() - start)
    print(f"{isa}, {args.dtype} {args.weights}, {args.rows} rows over {args.adapters} rank-{args.rank} adapters, "
          f"threads {torch.get_num_threads()}; LoRA logits bit-identical: {torch.equal(*logits)}")  # fmt: skip
    print("| library | base ms (best / median) | LoRA ms (best / median) | LoRA / base (best / median) |")
    print("|---|---|---|---|")
    for name in steps:
        base, lora = times[(name, "base")], times[(name, "lora")]
        print(
            f"| {name} | {min(base) * 1e3:.2f} / {statistics.median(base) * 1e3:.2f} | "
            f"{min(lora) * 1e3:.2f} / {statistics.median(lora) * 1e3:.2f} | "
            f"{min(base) / min(lora):.3f} / {statistics.median(base) / statistics.median(lora):.3f} |"
        )


if __name__ == "__main__":
    main()
