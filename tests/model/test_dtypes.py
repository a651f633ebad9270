"""``--dtype auto`` / ``--weights auto``: bfloat16 (and the GGUF's blocks) where bf16 is native, float32 (and the
folder) elsewhere, from the flags of a real cpuinfo file and torch's dispatch capability; the default of ``loraplex
serve``, logged with its reason and reported by ModelInfo as what it resolved to."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc

from service.cli import build_parser, serve_settings
from service.config import Settings
from service.model.dtypes import choose_dtype, choose_serving
from service.platform import cpu_capability, cpu_flags

CPU = torch.device("cpu")
# Two processors of an AVX-512 machine, as /proc/cpuinfo lists them; FLAGS is replaced per case.
CPUINFO = """processor\t: {n}
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512bw avx512vl FLAGS
bogomips\t: 5200.00

"""


def fake_cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text("".join(CPUINFO.format(n=n).replace("FLAGS", flags) for n in range(2)))
    return path


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ("avx512_bf16 avx512_vnni", torch.bfloat16),  # AMD Zen 4 / Intel Cooper Lake
        ("amx_bf16 amx_tile amx_int8", torch.bfloat16),  # Intel Sapphire Rapids and later
        ("avx512_vnni", torch.float32),  # AVX-512 without bf16 (Skylake / Ice Lake)
        ("", torch.float32),
        ("avx512_bf16x", torch.float32),  # whole flags only
    ],
)
def test_auto_on_cpu_follows_the_bf16_flags(tmp_path: Path, flags: str, want: torch.dtype) -> None:
    choice = choose_dtype("auto", CPU, cpuinfo=fake_cpuinfo(tmp_path, flags), capability="AVX512")
    assert choice.dtype == want
    assert choice.name == str(want).removeprefix("torch.")
    assert choice.reason.startswith("auto: native bf16" if want == torch.bfloat16 else "auto: no native bf16")
    assert str(tmp_path / "cpuinfo") in choice.reason


def test_an_explicit_dtype_is_taken_as_given(tmp_path: Path) -> None:
    info = fake_cpuinfo(tmp_path, "avx512_bf16")
    for name in ("float32", "bfloat16", "float16"):
        choice = choose_dtype(name, CPU, cpuinfo=info)
        assert choice.name == name and choice.reason == "given"


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_bf16_is_not_native_where_torch_is_forced_below_avx512(tmp_path: Path, capability: str) -> None:
    """ATEN_CPU_CAPABILITY=avx2 on an AMX machine runs torch's AVX2 kernels, which emulate bf16."""
    choice = choose_dtype("auto", CPU, cpuinfo=fake_cpuinfo(tmp_path, "amx_bf16 avx512_bf16"), capability=capability)
    assert choice.dtype == torch.float32
    assert f"torch dispatches to {capability}" in choice.reason


def test_unreadable_cpuinfo_means_float32(tmp_path: Path) -> None:
    assert cpu_flags(tmp_path / "missing") is None
    (tmp_path / "empty").write_text("processor\t: 0\n")
    assert cpu_flags(tmp_path / "empty") is None  # no flags line: not evidence of "no bf16"
    choice = choose_dtype("auto", CPU, cpuinfo=tmp_path / "missing", capability="AVX512")
    assert choice.dtype == torch.float32 and "no CPU flags could be read" in choice.reason


@pytest.mark.parametrize(
    ("flags", "capability", "weights", "want"),
    [
        ("amx_bf16", "AVX512", "auto", ("gguf", torch.bfloat16)),  # Sapphire Rapids without the kernels: bf16
        ("", "AVX2", "auto", ("folder", torch.float32)),  # AVX2-only EPYC: no emulated bf16
        ("amx_bf16", "AVX2", "auto", ("folder", torch.float32)),  # forced below AVX-512: as an AVX2 CPU
        ("", "AVX2", "given", ("gguf", torch.bfloat16)),  # GGUF asked for: bf16, the int4 kernel's fast dtype
        ("amx_bf16", "AVX512", "given", ("gguf", torch.bfloat16)),
    ],
)
@pytest.mark.parametrize("native_q4", [False, True], ids=["eager", "native"])
def test_weights_auto_chooses_by_the_machine(
    tmp_path: Path, flags: str, capability: str, weights: str, want: tuple[str, torch.dtype], native_q4: bool
) -> None:
    """With the native kernels loaded (``native_q4``) the GGUF's blocks serve in float32 on every CPU, native bf16
    or not: the default-correct dtype, faster than torch's int4 kernel in bf16 (an AMX Xeon: 6.1 vs 13.5 ms a step
    at batch 1)."""
    info = fake_cpuinfo(tmp_path, flags)
    if native_q4:
        want = ("gguf", torch.float32)
    choice = choose_serving("auto", weights, True, CPU, cpuinfo=info, capability=capability, native_q4=native_q4)
    assert (choice.weights, choice.dtype.dtype) == want
    assert choice.weights_reason == "given" if weights == "given" else choice.weights_reason.startswith("auto: ")
    assert choose_serving("auto", weights, False, CPU, cpuinfo=info, capability=capability).weights == "folder"
    explicit = choose_serving("float32", "auto", True, CPU, cpuinfo=info, capability=capability, native_q4=native_q4)
    # fp32 asked: the folder serves it, or the blocks through the native kernels
    assert (explicit.weights, explicit.dtype.dtype) == ("gguf" if native_q4 else "folder", torch.float32)


def test_auto_is_the_default_and_a_valid_flag() -> None:
    assert Settings().dtype == "auto"
    assert Settings.from_env({"LORAPLEX_DTYPE": "auto"}).dtype == "auto"
    assert serve_settings(build_parser().parse_args(["serve", "--dtype", "auto"]), {}).dtype == "auto"
    assert serve_settings(build_parser().parse_args(["serve"]), {}).dtype == "auto"
    assert serve_settings(build_parser().parse_args(["serve"]), {}).weights == "given"
    assert serve_settings(build_parser().parse_args(["serve", "--weights", "auto"]), {}).weights == "auto"
    with pytest.raises(ValueError, match="weights"):
        Settings.from_env({}, weights="fastest")
    with pytest.raises(ValueError, match="dtype"):
        Settings.from_env({}, dtype="fp8")


def test_server_logs_and_reports_the_resolved_dtype(served_tiny_dir: Path, caplog: Any) -> None:
    from support.servers import tiny_settings

    from service.api.server import BackgroundServer

    want = choose_dtype("auto", CPU)
    settings = tiny_settings(served_tiny_dir, dtype="auto")
    with caplog.at_level(logging.INFO), BackgroundServer(settings) as srv, grpc.insecure_channel(srv.target) as channel:
        info = pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=30)
    assert info.dtype == want.name != "auto"
    assert info.cpu_capability == cpu_capability() and info.weights == "folder"
    kinds = {p.path.split(" ")[0] for p in info.compute_paths}
    assert {"dense", "output", "LoRA", "attention,", "Medusa"} <= kinds  # projections, head, LoRA, attention, drafts
    assert all(p.status == "ok" and p.error <= p.tolerance for p in info.compute_paths)
    chosen = [r.getMessage() for r in caplog.records if "event=dtype_chosen" in r.getMessage()]
    assert len(chosen) == 1 and f"requested=auto dtype={want.name}" in chosen[0] and want.reason in chosen[0]
