"""The serving dtype: ``--dtype auto`` resolved, once, to what the device computes fast.

``auto`` is bfloat16 on a CPU with native bf16 arithmetic (``avx512_bf16`` or ``amx_bf16`` among the flags of
``/proc/cpuinfo``; torch's own capability check where that file cannot be read) and float32 on any other CPU,
where bf16 matrix products are emulated and slower than fp32. On CUDA it is bfloat16 where the GPU supports it,
float16 otherwise. An explicit dtype is taken as given. The choice carries its reason, for the start-up log.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CPU_BF16_FLAGS", "DtypeChoice", "choose_dtype", "cpu_flags"]

CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo flags of native bf16 dot products
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        """``float32``, ``bfloat16`` or ``float16``: the spelling of ``--dtype``."""
        return str(self.dtype).removeprefix("torch.")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The CPU feature flags in ``cpuinfo`` (every ``flags`` line; they agree), or None if it cannot be read."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags.update(value.split())
    return frozenset(flags) if flags else None


def choose_dtype(requested: str, device: torch.device, *, cpuinfo: Path = CPUINFO) -> DtypeChoice:
    """The dtype to serve in on ``device`` for ``--dtype requested`` (``auto`` or a torch dtype name)."""
    if requested != "auto":
        return DtypeChoice(getattr(torch, requested), "given")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto: the GPU supports bf16")
        return DtypeChoice(torch.float16, "auto: the GPU has no bf16, fp16 instead")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"auto: no fast-dtype rule for {device.type}")
    flags = cpu_flags(cpuinfo)
    if flags is None:
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        how = "torch's CPU capability check"
        return DtypeChoice(torch.bfloat16 if native else torch.float32, f"auto: {how} says bf16 is {_yes(native)}")
    found = sorted(flags & CPU_BF16_FLAGS)
    if found:
        return DtypeChoice(torch.bfloat16, f"auto: native bf16 on this CPU ({', '.join(found)} in {cpuinfo})")
    return DtypeChoice(torch.float32, f"auto: no native bf16 on this CPU (no avx512_bf16 / amx_bf16 in {cpuinfo})")


def _yes(native: bool) -> str:
    return "native" if native else "not native"
