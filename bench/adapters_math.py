"""Micro-benchmark of the mixed-adapter LoRA math: one decode step of the real model, base-only vs with adapters.

    .venv/bin/python bench/adapters_math.py [--dtype float32 bfloat16] [--adapters 1 4 16 32] [--compare]
        [--gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --kernel]

``--rows`` rows (default 32) decode one token each over a ``--context``-token KV cache (forward + logits, as the
engine's decode step); row ``i`` uses adapter ``i % N`` (``--row-order grouped``: rows of one adapter side by side,
as if the engine kept slots ordered by adapter; the shared layout then moves no rows). Adapters are random
``LoraLayer`` objects of rank ``--rank`` on ``--modules`` (``qv`` or ``all``; ``--mixed-ranks`` cycles ranks
4/8/16). Reported: ms per step (best and median of interleaved rounds, so a shared machine's drift hits every
variant alike) and throughput relative to the base-only step (1.00 = LoRA costs nothing). The clock is the process's
CPU time unless ``--wall``: on a shared machine it is much steadier, and with one thread (``--threads 1``) it is the
step's cost.

``auto N=..`` is ``AdapterBatch`` on eager torch; ``--kernel`` adds each AdapterBatch variant on the compiled LoRA
kernel (``kernel auto N=..``: ``NativeKernels.lora_delta``, one call per (layer, site), as the engine uses it on a
CPU with the library loaded). ``--compare`` also forces each of its two layouts at
every N (``slots``: per-slot tables + bmm; ``shared``: per adapter, its rows gathered, its stacked A and its B
applied, scattered back: no row meets another adapter's weights), and times at the largest N the other
alternatives weighed:

- ``grouped``: per adapter, index_select its rows, two small matmuls, index_add back;
- ``gather``: per step, index_select each row's weights from rank-padded stacks (cached), then bmm.

``--profile`` prints torch.profiler's op table (self CPU time) of a few steps of ``auto`` at the largest N and of
the base step: where the LoRA time goes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from service.adapters.lora.batch import SITES, AdapterBatch, LoraTables, Mode, module_layout
from service.adapters.lora.types import LoraLayer, LoraModule
from service.model import KVCache, Llama, ModelConfig
from service.model.hooks import HeadPart, NormName, NormWith, ProjName

Adapter = dict[int, LoraLayer]


def random_adapters(
    cfg: ModelConfig, n: int, ranks: Sequence[int], modules: Sequence[str], dtype: torch.dtype
) -> list[Adapter]:
    layout = module_layout(cfg)
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        r = ranks[i % len(ranks)]
        layers = {}
        for layer in range(cfg.num_layers):
            mods = {}
            for m in modules:
                spec = layout[m]
                a = torch.randn(r, spec.in_features, generator=gen) / spec.in_features**0.5
                b = torch.randn(spec.out_features, r, generator=gen) * (0.1 / r**0.5)
                mods[m] = LoraModule(a=a.to(dtype), b=b.to(dtype))
            layers[layer] = LoraLayer(mods, sum(x.a.nbytes + x.b.nbytes for x in mods.values()))
        out.append(layers)
    return out


class ProjectionsOnly:
    """The parts of ``AdapterHook`` a projections-only contender leaves as the base computes them."""

    def embed(self, x: Tensor, tokens: Tensor) -> Tensor:
        return x

    def norm(self, out: Tensor, x: Tensor, layer: int, name: NormName, norm_with: NormWith) -> Tensor:
        return out

    def head_parts(self, rows: Sequence[int] | None, n: int) -> list[HeadPart] | None:
        return None

    def stack_lora(self) -> None:
        return None


class Grouped(ProjectionsOnly):
    """Per adapter group: index_select rows, x @ A^T @ B^T, index_add into the fused output columns."""

    def __init__(self, cfg: ModelConfig, adapters: list[Adapter], row_adapter: list[int]) -> None:
        self.layout = module_layout(cfg)
        self.adapters = adapters
        groups: dict[int, list[int]] = {}
        for row, a in enumerate(row_adapter):
            groups.setdefault(a, []).append(row)
        self.groups = [(a, torch.tensor(rows)) for a, rows in groups.items()]

    def add_delta(self, out: Tensor, x: Tensor, layer: int, name: ProjName) -> Tensor:
        for a, rows in self.groups:
            mods = self.adapters[a][layer].modules
            xs = x.index_select(0, rows)  # [g, T, in]
            for m in SITES[name]:
                if m in mods:
                    c0, c1 = self.layout[m].cols
                    d = F.linear(F.linear(xs, mods[m].a), mods[m].b)  # [g, T, out_m]
                    out[..., c0:c1].index_add_(0, rows, d.to(out.dtype))
        return out


class Gather(ProjectionsOnly):
    """Rank-padded stacks per (layer, module) of the active adapters (cached); per step gather rows, bmm."""

    def __init__(self, cfg: ModelConfig, adapters: list[Adapter], row_adapter: list[int], cdt: torch.dtype) -> None:
        self.layout = module_layout(cfg)
        self.cdt = cdt
        self.idx = torch.tensor(row_adapter)
        n = len(adapters)
        self.stacks: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        for layer in range(cfg.num_layers):
            for m in self.layout:
                mods = [adapters[a][layer].modules.get(m) for a in range(n)]
                if all(x is None for x in mods):
                    continue
                r = max(x.rank for x in mods if x is not None)
                spec = self.layout[m]
                at = torch.zeros(n, spec.in_features, r, dtype=cdt)
                bt = torch.zeros(n, r, spec.out_features, dtype=cdt)
                for i, x in enumerate(mods):
                    if x is not None:
                        at[i, :, : x.rank] = x.a.t()
                        bt[i, : x.rank] = x.b.t()
                self.stacks[(layer, m)] = (at, bt)

    def add_delta(self, out: Tensor, x: Tensor, layer: int, name: ProjName) -> Tensor:
        xc = x.to(self.cdt)
        for m in SITES[name]:
            stack = self.stacks.get((layer, m))
            if stack is None:
                continue
            at, bt = (s.index_select(0, self.idx) for s in stack)
            c0, c1 = self.layout[m].cols
            out[..., c0:c1] += torch.bmm(torch.bmm(xc, at), bt)
        return out


def time_step(step: Callable[[], None], rounds: int, clock: Callable[[], float]) -> list[float]:
    times = []
    for _ in range(rounds):
        t0 = clock()
        step()
        times.append(clock() - t0)
    return times


def run(args: argparse.Namespace, dtype: torch.dtype) -> None:
    from service.bootstrap import WEIGHT_FORMATS
    from service.config import Settings

    model: Llama
    # The folder, or the GGUF's Q4 blocks (float32: the compiled kernels and the one-call step).
    load = WEIGHT_FORMATS["folder" if args.gguf is None else "gguf"]
    model, cfg, _ = load(Settings(model=args.model, gguf=args.gguf), dtype, torch.device("cpu"))
    rows, ctx = args.rows, args.context
    cache = KVCache(cfg, rows, ctx + 2, dtype=dtype, device=model.device)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(
            torch.randint(0, cfg.vocab_size, (rows, ctx), generator=gen), torch.arange(ctx).expand(rows, ctx), cache, 0
        )
    nxt = torch.randint(0, cfg.vocab_size, (rows, 1), generator=gen)
    pos = torch.full((rows, 1), ctx)
    modules = ("q_proj", "v_proj") if args.modules == "qv" else tuple(m for ms in SITES.values() for m in ms)
    ranks = (4, 8, 16) if args.mixed_ranks else (args.rank,)
    adapters = random_adapters(cfg, max(args.adapters), ranks, modules, dtype)
    names = [f"a{i}" for i in range(len(adapters))]
    by_name = dict(zip(names, adapters, strict=True))

    def lookup(adapter_id: str, layer: int) -> LoraLayer | None:
        return by_name[adapter_id].get(layer)

    def make_step(hook_for_step: Callable[[], Any]) -> Callable[[], None]:
        def step() -> None:
            with torch.inference_mode():
                hidden = model(nxt, pos, cache, 0, adapters=hook_for_step(), kv_len=ctx + 1)
                model.logits(hidden[:, -1])

        hidden, attn, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size
        widths = {site: module_layout(cfg)[mods[-1]].cols[1] for site, mods in SITES.items()}
        xs = {"wqkv": hidden, "wo": attn, "w13": hidden, "w2": inter}
        x_of = {site: torch.randn(rows, 1, n, generator=gen).to(dtype) for site, n in xs.items()}
        out_of = {site: torch.zeros(rows, 1, widths[site], dtype=dtype) for site in SITES}

        def hook_only() -> None:  # the LoRA work of one step without the base model around it
            with torch.inference_mode():
                hook = hook_for_step()
                for layer in range(cfg.num_layers):
                    for site in SITES:
                        hook.add_delta(out_of[site], x_of[site], layer, site)

        return hook_only if args.hook_only and hook_for_step() is not None else step

    variants: dict[str, Callable[[], None]] = {"base": make_step(lambda: None)}
    tables_of: dict[str, LoraTables] = {}
    modes: tuple[Mode, ...] = ("auto", "slots", "shared") if args.compare else ("auto",)
    paths = {"": None, "kernel ": model.lora_native} if args.kernel and model.lora_native is not None else {"": None}
    for n in args.adapters:
        row_ids = [names[i % n] for i in range(rows)]
        if args.row_order == "grouped":
            row_ids.sort()  # the order AdapterBatch groups them in: no row moves
        for mode in modes:
            for prefix, kern in paths.items():
                tables = LoraTables(cfg, device="cpu", dtype=dtype, native=kern)
                name = f"{prefix}{mode} N={n}"
                tables_of[name] = tables
                variants[name] = make_step(
                    lambda row_ids=row_ids, tables=tables, mode=mode: AdapterBatch.build(
                        row_ids, lookup, tables, mode=mode
                    )
                )
    if args.compare:
        n = max(args.adapters)
        row_adapter = [i % n for i in range(rows)]
        cdt = tables_of[f"auto N={n}"].compute_dtype
        grouped = Grouped(cfg, adapters, row_adapter)
        gather = Gather(cfg, adapters, row_adapter, cdt)
        variants[f"grouped N={n}"] = make_step(lambda: grouped)
        variants[f"gather N={n}"] = make_step(lambda: gather)
    # CPU time of this process: on a shared machine it is far steadier than wall time (which --wall selects).
    clock = time.perf_counter if args.wall else time.process_time
    for step in variants.values():
        step()  # warm-up: rope table, allocator, the slot tables' first fill
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):  # interleave so drift on a shared machine hits every variant alike
        for name, step in variants.items():
            times[name] += time_step(step, args.steps, clock)
    if args.profile:
        top = f"auto N={max(args.adapters)}"
        profile_ops({"base": variants["base"], top: variants[top]})
    base_best, base_med = min(times["base"]), statistics.median(times["base"])
    print(
        f"-- {dtype} rows={rows} context={ctx} modules={args.modules} ranks={ranks} threads={torch.get_num_threads()} "
        f"clock={'wall' if args.wall else 'process CPU'}{' hook-only' if args.hook_only else ''}"
    )
    for name, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        if args.hook_only and name != "base":  # ms of LoRA work alone; throughput = base / (base + LoRA)
            best, med = base_best + best, base_med + med
        extra = ""
        if name in tables_of:
            tables = tables_of[name]
            layout = "shared" if tables.layouts() == {} else "slots"
            extra = f"  [{layout}] tables {tables.nbytes / 2**20:.1f} MiB"
        print(
            f"{name:>21}: best {best * 1e3:7.1f} ms  median {med * 1e3:7.1f} ms  "
            f"throughput vs base: best {base_best / best:.3f}  median {base_med / med:.3f}{extra}",
            flush=True,
        )


def profile_ops(steps: dict[str, Callable[[], None]], rows: int = 15) -> None:
    """torch.profiler's table of the ops that took the most self CPU time over 5 runs of each step."""
    from torch.profiler import ProfilerActivity, profile

    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
        print(f"-- profile of 5 x {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    parser.add_argument("--gguf", type=Path, default=None, help="this GGUF's weights (the model folder's config)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--mixed-ranks", action="store_true")
    parser.add_argument("--modules", choices=["qv", "all"], default="qv")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", action="store_true", help="also time the alternative layouts at the largest N")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--kernel",
        action="store_true",
        help="also run each variant of AdapterBatch on the compiled LoRA kernel (named 'kernel ...'), side by side",
    )
    parser.add_argument(
        "--row-order",
        choices=["interleaved", "grouped"],
        default="interleaved",
        help="row i uses adapter i %% N (interleaved) or rows sorted by adapter (grouped)",
    )
    parser.add_argument("--profile", action="store_true", help="print the op profile of auto at the largest N")
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of process CPU time")
    parser.add_argument(
        "--hook-only",
        action="store_true",
        help="time the variants' LoRA work alone (every layer's add_delta on decode-shaped inputs) and add it to "
        "the base step: steadier than timing whole steps on a busy machine",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in args.dtype:
        run(args, getattr(torch, name))


if __name__ == "__main__":
    main()
