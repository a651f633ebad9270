"""How int4 weights are turned back into values, per CPU capability: the three ways the portability issue named.

    .venv/bin/python bench/int4_layout.py [--repeats 20] [--json bench/results/int4_layout.json]

torch's int4 packed layout is private and differs by capability. Dequantizing (prefill, large batches, dense
copies) needs its inverse; the candidates, each timed on SmolLM2-135M's four projection shapes in bf16:

- ``derived``: the unpack ``service.model.weights.int4_layout`` derives from the packer at first use (what ships): no
  memory beyond the packed weight; the derivation's one-time cost is reported too;
- ``own copy``: keep a second, row-major copy of the 4-bit values the project owns and unpack that (``q & 15``,
  ``q >> 4`` interleaved): as fast as unpacking gets, for N * K / 2 more bytes per weight;
- ``kernel``: multiply an identity matrix through the int4 kernel (exact, no memory, one [K, K] x [N, K] product).

Each capability runs in a fresh interpreter with ``ATEN_CPU_CAPABILITY`` forced (the machine's own, avx2, default);
the paths alternate call by call and the best of ``--repeats`` is printed in ms per layer (all four shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w13": (3072, 576), "w2": (576, 1536)}
CAPABILITIES = (None, "avx2", "default")


def _best(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {k: v * 1e3 for k, v in best.items()}


def measure(repeats: int) -> dict[str, object]:
    """One capability (this interpreter's): ms per layer for each way, derivation ms, bytes."""
    import machine as bench_machine
    import torch

    from service.model.weights import Int4Weight, int4_layout

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    weights, own, outs = {}, {}, {}
    derive_ms = 0.0
    for name, (n, k) in SHAPES.items():
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        w = Int4Weight.from_q_scale_zero(q.to(torch.uint8), torch.rand(n, k // 32), torch.rand(n, k // 32), 32,
                                         dtype=torch.bfloat16)  # fmt: skip
        t0 = time.perf_counter()
        int4_layout.derive(int4_layout.pack_cpu, n, k)
        derive_ms += (time.perf_counter() - t0) * 1e3
        weights[name] = w
        own[name] = (q[:, 0::2] | q[:, 1::2] << 4).to(torch.uint8)  # [N, K / 2]: low nibble = even column
        outs[name] = torch.empty(n, k, dtype=torch.bfloat16)

    def derived() -> None:
        for name, w in weights.items():
            w.layout.unpack(w.packed, outs[name])

    def own_copy() -> None:
        for name, p in own.items():
            out = outs[name].view(p.shape[0], -1, 2)
            out[..., 0].copy_(p & 15)
            out[..., 1].copy_(p >> 4)

    eyes = {k: torch.eye(k, dtype=torch.bfloat16) for _, k in SHAPES.values()}

    def kernel() -> None:
        for w in weights.values():
            w.matmul(eyes[w.shape[1]])

    own_copy()
    for name, w in weights.items():  # the own copy holds the same values as the derived unpack
        if not torch.equal(outs[name], w.unpack().to(torch.bfloat16)):
            raise SystemExit(f"{name}: the own copy and the derived unpack disagree")
    times = _best({"derived": derived, "own copy": own_copy, "kernel": kernel}, repeats)
    packed = sum(w.packed.numel() for w in weights.values())
    return {
        "machine": bench_machine.describe(),
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "ms_per_layer": times,
        "derive_ms_all_shapes": derive_ms,
        "extra_bytes_per_layer": {"derived": 0, "own copy": packed, "kernel": 0},
        "forms": {name: w.layout.form for name, w in weights.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child: this capability only
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.repeats)))
        return 0
    results = []
    for capability in CAPABILITIES:
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability is not None:
            env["ATEN_CPU_CAPABILITY"] = capability
        cmd = [sys.executable, __file__, "--one", "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"Machine: {results[0]['machine']['cpu']}")
    print("| capability | derived | own copy | kernel (identity) | derive once (4 shapes) | forms |")
    print("|---|---|---|---|---|---|")
    for r in results:
        t = r["ms_per_layer"]
        forms = ", ".join(sorted(set(r["forms"].values())))
        print(f"| {r['capability']} | {t['derived']:.2f} | {t['own copy']:.2f} | {t['kernel']:.2f} | "
              f"{r['derive_ms_all_shapes']:.0f} | {forms} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
