"""Why only the engine thread runs torch's parallel kernels (service/torch_threads.py): one decode step of the real
model on an "engine" thread, in a fresh process per case, alternating the cases round by round.

    .venv/bin/python bench/thread_pools.py [--rounds 5] [--steps 40] [--threads 2] [--weights gguf|bf16]

Cases (what the engine thread's process did before it):
- ``lone``: only the engine thread ever ran parallel kernels (loraplex now: the load ran on a thread that exited,
  every other thread runs torch serially);
- ``loaded-elsewhere``: the model was loaded on another thread that is still alive, as before the fix
  (``asyncio.to_thread`` kept the default executor's thread, and with it its OpenMP workers);
- ``main-thread``: the step on the thread that loaded the model (what a plain script measures).

Prints the median ms per step of each case over the rounds and the ratio to ``lone``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
sys.path.insert(0, str(ROOT))
CASES = ("lone", "loaded-elsewhere", "main-thread")


def child(case: str, weights: str, threads: int, steps: int) -> float:
    import torch

    from service.model import KVCache
    from service.model.load_folder import load_model
    from service.model.load_gguf import load_gguf_model

    def load() -> object:
        torch.set_num_threads(threads)
        if weights == "gguf":
            return load_gguf_model(MODEL, MODEL.parent / f"{MODEL.name}.Q4_1.gguf", dtype=torch.bfloat16)[0]
        return load_model(MODEL, dtype=torch.bfloat16, device="cpu")[0]

    loaded: list[object] = []
    keep_alive = threading.Event()
    holder: threading.Thread | None = None
    if case == "loaded-elsewhere":  # a loader thread that outlives the load, as the old default executor's did
        ready = threading.Event()

        def loader() -> None:
            loaded.append(load())
            ready.set()
            keep_alive.wait()

        holder = threading.Thread(target=loader)
        holder.start()
        ready.wait()
    elif case == "lone":
        t = threading.Thread(target=lambda: loaded.append(load()))
        t.start()
        t.join()
    else:
        loaded.append(load())
    model = loaded[0]
    cfg = model.cfg  # type: ignore[attr-defined]
    result: list[float] = []

    def engine() -> None:
        torch.get_num_threads()
        torch.set_num_threads(threads)
        cache = KVCache(cfg, 1, 64 + steps + 8, dtype=torch.bfloat16, device=torch.device("cpu"))
        token = torch.zeros(1, 1, dtype=torch.long)
        times = []
        for i in range(steps + 5):
            pos = torch.full((1, 1), 32 + i, dtype=torch.long)
            t0 = time.perf_counter()
            model.logits(model(token, pos, cache, 0, kv_len=33 + i)[:, -1])  # type: ignore[operator, attr-defined]
            times.append(time.perf_counter() - t0)
        result.append(statistics.median(times[5:]) * 1e3)

    if case == "main-thread":
        engine()
    else:
        t = threading.Thread(target=engine)
        t.start()
        t.join()
    keep_alive.set()
    if holder is not None:
        holder.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", choices=("gguf", "bf16"), default="gguf")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.weights, args.threads, args.steps)))
        return
    ms: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            cmd = [sys.executable, __file__, "--child", case, "--weights", args.weights,
                   "--threads", str(args.threads), "--steps", str(args.steps)]  # fmt: skip
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            ms[case].append(float(out.stdout.strip().splitlines()[-1]))
    lone = statistics.median(ms["lone"])
    print(f"{args.weights}, batch 1, {args.threads} threads, median ms/step of {args.rounds} processes each")
    print("| case | ms/step | per round | vs lone |\n|---|---|---|---|")
    for case in CASES:
        med = statistics.median(ms[case])
        rounds = ", ".join(f"{v:.1f}" for v in ms[case])
        print(f"| {case} | {med:.1f} | {rounds} | {med / lone:.2f} |")


if __name__ == "__main__":
    main()
