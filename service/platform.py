"""What the machine under the server is: the CPU capability torch dispatches its kernels to, and native bf16.

The same image runs on AVX2-only, AVX-512 and AMX nodes (and aarch64), and ``ATEN_CPU_CAPABILITY`` may force torch
lower than the CPU allows. Every decision that depends on the machine (the serving dtype and weight source, the
dtype Medusa drafts in, what the self-check reports) asks this module, so they agree with each other and with what
torch actually runs. Reads ``/proc/cpuinfo`` when asked, never at import; nothing here uses a private torch op.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CPUINFO", "CPU_BF16_FLAGS", "Machine", "cpu_capability", "cpu_flags", "draft_dtype", "machine"]

CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo flags of native bf16 dot products
CPUINFO = Path("/proc/cpuinfo")
# torch capabilities whose bf16 kernels use the CPU's bf16 instructions (under AVX2 or DEFAULT they convert)
BF16_CAPABILITIES = frozenset({"AVX512"})


def cpu_capability() -> str:
    """The capability torch dispatches to: "DEFAULT", "AVX2", "AVX512" on x86; others on aarch64 / POWER / s390x."""
    return str(torch.backends.cpu.get_cpu_capability())


def _read(cpuinfo: Path) -> str | None:
    try:
        return cpuinfo.read_text(errors="replace")
    except OSError:
        return None


def _fields(text: str, name: str) -> list[str]:
    """The values of every ``name : value`` line of a cpuinfo text."""
    out = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            out.append(value.strip())
    return out


def _flags(text: str | None) -> frozenset[str] | None:
    flags = {f for line in _fields(text, "flags") for f in line.split()} if text is not None else set()
    return frozenset(flags) if flags else None


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The CPU feature flags in ``cpuinfo`` (every ``flags`` line; they agree), or None if it cannot be read."""
    return _flags(_read(cpuinfo))


@dataclass(frozen=True)
class Machine:
    """One CPU as the server sees it."""

    model: str  # "Intel(R) Xeon(R) Processor", from cpuinfo
    arch: str  # platform.machine(): "x86_64", "aarch64"
    capability: str  # torch's dispatch capability (cpu_capability)
    bf16_flags: tuple[str, ...]  # the CPU's native bf16 flags found in cpuinfo (empty: none, or unreadable)
    flags_read: bool  # whether cpuinfo listed flags at all

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run on bf16 instructions: the CPU has them and torch dispatches to a capability that
        uses them (``ATEN_CPU_CAPABILITY=avx2`` on an AMX machine emulates bf16 like an AVX2-only CPU)."""
        return bool(self.bf16_flags) and self.capability in BF16_CAPABILITIES

    def describe_bf16(self, cpuinfo: Path = CPUINFO) -> str:
        if not self.flags_read:
            return f"no CPU flags could be read from {cpuinfo}: bf16 is taken as not native"
        if not self.bf16_flags:
            return f"no native bf16 on this CPU (no avx512_bf16 / amx_bf16 in {cpuinfo})"
        found = ", ".join(self.bf16_flags)
        if not self.native_bf16:
            return f"the CPU has {found} but torch dispatches to {self.capability}, whose bf16 kernels emulate it"
        return f"native bf16 on this CPU ({found} in {cpuinfo}; torch capability {self.capability})"


def machine(cpuinfo: Path = CPUINFO, *, capability: str | None = None) -> Machine:
    """This machine (or the one ``cpuinfo`` describes, for tests; ``capability`` likewise)."""
    text = _read(cpuinfo)  # one read for the flags and the model name
    flags = _flags(text)
    found = tuple(sorted((flags or frozenset()) & CPU_BF16_FLAGS))
    cap = cpu_capability() if capability is None else capability
    names = _fields(text, "model name") if text is not None else []
    model = names[0] if names else (platform.processor() or platform.machine())
    return Machine(model, platform.machine(), cap, found, flags is not None)


def draft_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype Medusa heads draft in: bf16 for a float32 model where bf16 matmuls are fast (CUDA; a CPU with
    native bf16), else the model's own. A draft only has to be likely: verification runs in the model dtype."""
    if model_dtype != torch.float32:
        return model_dtype
    fast = device.type == "cuda" or (device.type == "cpu" and machine().native_bf16)
    return torch.bfloat16 if fast else model_dtype
