"""The serving dtype and weight source: ``--dtype auto`` and ``--weights auto`` resolved, once, for this machine.

dtype ``auto`` on a CPU is bfloat16 where bf16 is native (the CPU has ``avx512_bf16`` / ``amx_bf16`` and torch
dispatches to a capability that uses them, ``service.platform``) and float32 elsewhere, where bf16 matrix products
are emulated and slower than fp32 (an AVX2-only EPYC: 37 vs 95 tok/s at 32 streams). Served from a GGUF's 4-bit
blocks, ``auto`` is float32 on every CPU where loraplex's compiled kernels are loaded: they beat torch's int4
kernel in bf16 even where bf16 is native (an AMX Xeon, one decode step: 6.1 vs 13.5 ms at batch 1, 78 vs 102 ms at
32), and float32 is the default-correct dtype. Without them it is bfloat16, since torch's int4 kernel is fast only
with bf16 activations (an AVX2 EPYC at batch 1: 24.7 tok/s in bf16, 5.0 in float32). On CUDA ``auto`` is bfloat16
where the GPU supports it, float16 otherwise.

weights ``given`` serves what the flags name (``--gguf``'s file when given, else the folder). ``auto`` lets the
machine choose between them: the GGUF's blocks in float32 wherever the compiled kernels are loaded, else the GGUF in
bf16 where bf16 is native and the folder in float32 elsewhere (no emulated bf16). Either way the start-up
self-check (``service.selfcheck``) proves the chosen paths correct before the server says SERVING.
An explicit dtype is taken as given. Each choice carries its reason, for the start-up log.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from service.platform import CPUINFO, Machine, machine

__all__ = ["DtypeChoice", "ServingChoice", "choose_dtype", "choose_serving"]


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        """``float32``, ``bfloat16`` or ``float16``: the spelling of ``--dtype``."""
        return str(self.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ServingChoice:
    dtype: DtypeChoice
    gguf: bool  # serve the GGUF file's blocks (else the folder's safetensors)
    weights_reason: str

    @property
    def weights(self) -> str:
        return "gguf" if self.gguf else "folder"


def choose_dtype(
    requested: str,
    device: torch.device,
    *,
    gguf: bool = False,
    native_q4: bool = False,
    cpuinfo: Path = CPUINFO,
    capability: str | None = None,
    cpu: Machine | None = None,
) -> DtypeChoice:
    """The dtype to serve in on ``device`` for ``--dtype requested`` (``auto`` or a torch dtype name); ``gguf``:
    the weights are a GGUF's 4-bit blocks; ``native_q4``: loraplex's native kernels multiply them in float32
    (``service.kernels.native``). ``cpu``: the machine when the caller has read it already."""
    if requested != "auto":
        return DtypeChoice(getattr(torch, requested), "given")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto: the GPU supports bf16")
        return DtypeChoice(torch.float16, "auto: the GPU has no bf16, fp16 instead")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"auto: no fast-dtype rule for {device.type}")
    m = machine(cpuinfo, capability=capability) if cpu is None else cpu
    if gguf and native_q4:  # faster than torch's int4 kernel in bf16, native bf16 or not
        return DtypeChoice(torch.float32, f"auto: GGUF blocks run the native kernels in float32 ({_why(m)})")
    if m.native_bf16:
        return DtypeChoice(torch.bfloat16, f"auto: {m.describe_bf16(cpuinfo)}")
    if gguf:
        return DtypeChoice(torch.bfloat16, f"auto: GGUF blocks run torch's int4 kernel, fast only in bf16 ({_why(m)})")
    return DtypeChoice(torch.float32, f"auto: {m.describe_bf16(cpuinfo)}")


def choose_serving(
    dtype: str,
    weights: str,
    has_gguf: bool,
    device: torch.device,
    *,
    native_q4: bool = False,
    cpuinfo: Path = CPUINFO,
    capability: str | None = None,
) -> ServingChoice:
    """dtype and weight source for ``--dtype dtype --weights weights`` (``given`` | ``auto``) on this machine;
    ``native_q4``: the native kernels are loaded, so GGUF blocks run fast in float32 too."""
    m = machine(cpuinfo, capability=capability) if device.type == "cpu" else None
    if weights == "given" or not has_gguf or m is None:
        gguf = has_gguf and weights == "given"
        reason = "given" if weights == "given" else "auto: no --gguf file, or not on a CPU: the folder"
        chosen = choose_dtype(dtype, device, gguf=gguf, native_q4=native_q4, cpuinfo=cpuinfo, cpu=m)
        return ServingChoice(chosen, gguf, reason)
    # with the native kernels the blocks' dtype (float32), else the folder's
    wanted = choose_dtype(dtype, device, gguf=native_q4, native_q4=native_q4, cpuinfo=cpuinfo, cpu=m)
    if wanted.dtype == torch.float32 and native_q4:
        return ServingChoice(wanted, True, f"auto: the GGUF's 4-bit blocks in float32, native kernels ({_why(m)})")
    if wanted.dtype == torch.float32:
        return ServingChoice(
            wanted, False, f"auto: float32 serves the folder (the int4 kernel is slow in fp32; {_why(m)})"
        )
    return ServingChoice(wanted, True, f"auto: the GGUF's 4-bit blocks in {wanted.name} ({_why(m)})")


def _why(m: Machine) -> str:
    return f"{m.model}, torch capability {m.capability}, native bf16 {'yes' if m.native_bf16 else 'no'}"
