"""The machine a benchmark ran on, as every result file records it: CPU model, torch's capability, bf16 / AMX.

Figures are only comparable within one kind of CPU (an AVX2-only EPYC, an AVX-512 + BF16 EPYC, a Sapphire Rapids
with AMX), so every result names its own (``describe``), and ``line`` is the one-line form for bench/README.md.
"""

from __future__ import annotations

import os
import platform
from typing import Any

from service.platform import cpu_flags, machine


def describe() -> dict[str, Any]:
    """CPU model, architecture, torch capability (forced or not), native bf16 / AMX, CPUs, load average now."""
    m = machine()
    flags = cpu_flags() or frozenset()
    return {
        "cpu": m.model,
        "arch": m.arch,
        "torch_capability": m.capability,
        "forced_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
        "native_bf16": m.native_bf16,
        "amx": "amx_bf16" in flags,
        "avx512": "avx512f" in flags,
        "cpus": len(os.sched_getaffinity(0)),
        "kernel": f"Linux {platform.release()}",
        "load_avg": os.getloadavg(),
    }


def line(d: dict[str, Any] | None = None) -> str:
    """e.g. "Intel(R) Xeon(R) Processor, 2 CPUs, torch AVX512, AVX-512, AMX, native bf16"."""
    d = describe() if d is None else d
    isa = "AVX-512" if d["avx512"] else "no AVX-512"
    forced = f" (forced by ATEN_CPU_CAPABILITY={d['forced_capability']})" if d["forced_capability"] else ""
    bf16 = "native bf16" if d["native_bf16"] else "no native bf16"
    amx = "AMX, " if d["amx"] else ""
    return f"{d['cpu']}, {d['cpus']} CPUs, torch {d['torch_capability']}{forced}, {isa}, {amx}{bf16}"
