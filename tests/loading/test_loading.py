"""load_tensors: bit-identical to safetensors.torch.load_file in every mode, into plain, fused, strided and
dtype-converting destinations; plan errors named before any byte is read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import get_args

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.safetensors_cases import sample_tensors, write_sharded

from service.config import LOAD_MODES
from service.errors import HeaderError, TensorMismatch
from service.loading import CheckpointIndex, LoadMode, load_tensors
from service.loading import stream as stream_mod
from service.loading.plan import Job

MODES = ["stream", "mmap", "eager"]


def _reference(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _garbage_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    if out.numel():
        out.reshape(-1).view(torch.uint8).fill_(0xA5)
    return out


def test_every_load_mode_is_a_settings_choice() -> None:
    """``LoadMode`` is defined once (the loader); the CLI / settings choices must list each of its values."""
    assert sorted(LOAD_MODES) == sorted(get_args(LoadMode))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n_shards", [1, 3])
def test_bit_identical_to_load_file(tmp_path: Path, mode: str, n_shards: int) -> None:
    tensors = sample_tensors()
    if n_shards == 1:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    else:
        write_sharded(tmp_path, tensors, n_shards)
    ref = _reference(tmp_path)
    index = CheckpointIndex.open(tmp_path)
    plan = {name: _garbage_like(t) for name, t in ref.items()}
    stats = load_tensors(index, plan, mode=mode, unexpected="error")  # type: ignore[arg-type]
    for name in ref:
        assert _same_bits(plan[name], ref[name]), name
    assert stats.mode == mode and stats.tensors == len(ref)
    assert stats.bytes_read >= sum(t.numel() * t.element_size() for t in ref.values())
    assert stats.total_seconds >= stats.header_seconds >= 0


def test_optional_dtypes_bit_identical(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 255, (64,), generator=g, dtype=torch.uint8)
    tensors: dict[str, torch.Tensor] = {}
    for attr in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        dt = getattr(torch, attr, None)
        if isinstance(dt, torch.dtype):
            tensors[attr] = bits[: 64 - 64 % dt.itemsize].view(dt).clone()
    save_file(tensors, str(tmp_path / "x.safetensors"))
    ref = load_file(str(tmp_path / "x.safetensors"))
    plan = {n: _garbage_like(t) for n, t in ref.items()}
    load_tensors(CheckpointIndex.open(tmp_path), plan)
    for n in ref:
        assert _same_bits(plan[n], ref[n]), n


def test_large_tensors_threaded_and_chunked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small chunks and a low threading threshold force many vectored reads across worker threads."""
    monkeypatch.setattr(stream_mod, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(stream_mod, "STAGE_BYTES", 4096)
    monkeypatch.setattr(stream_mod, "MIN_THREADED_BYTES", 0)
    g = torch.Generator().manual_seed(2)
    tensors = {f"w{i}": torch.randn(37 + i, 101, generator=g) for i in range(12)}
    tensors.update({f"small{i}": torch.randn(3, generator=g) for i in range(40)})
    write_sharded(tmp_path, tensors, 2)
    ref = _reference(tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        plan = {n: torch.empty(t.shape, dtype=dtype) for n, t in ref.items()}
        load_tensors(CheckpointIndex.open(tmp_path), plan, threads=3)
        for n, t in ref.items():
            assert _same_bits(plan[n], t.to(dtype)), (n, dtype)


def test_fused_slices_receive_their_rows(tmp_path: Path) -> None:
    """q/k/v stream into row blocks of one fused parameter (direct reads into a view)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(8, 6, generator=g), torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    save_file({"q": q, "k": k, "v": v, "other": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    for mode in MODES:
        qkv = torch.nn.Parameter(torch.full((16, 6), float("nan")))
        plan = {"q": qkv[0:8], "k": qkv[8:12], "v": qkv[12:16]}
        load_tensors(CheckpointIndex.open(tmp_path), plan, mode=mode)  # type: ignore[arg-type]
        assert _same_bits(qkv.detach(), torch.cat([q, k, v])), mode


@pytest.mark.parametrize("mode", MODES)
def test_dtype_converting_destinations(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_mod, "CONVERT_ELEMS", 64)
    g = torch.Generator().manual_seed(4)
    f32 = torch.randn(50, 30, generator=g)
    bf16 = torch.randn(40, generator=g).bfloat16()
    i32 = torch.randint(-1000, 1000, (10,), generator=g, dtype=torch.int32)
    save_file({"f32": f32, "bf16": bf16, "i32": i32}, str(tmp_path / "model.safetensors"))
    fused = torch.zeros(60, 30, dtype=torch.bfloat16)
    plan = {"f32": fused[10:], "bf16": torch.empty(40, dtype=torch.float32), "i32": torch.empty(10, dtype=torch.int64)}
    load_tensors(CheckpointIndex.open(tmp_path), plan, mode=mode)  # type: ignore[arg-type]
    assert _same_bits(fused[10:], f32.to(torch.bfloat16))
    assert torch.count_nonzero(fused[:10]) == 0
    assert _same_bits(plan["bf16"], bf16.float())
    assert _same_bits(plan["i32"], i32.long())


@pytest.mark.parametrize(("stage", "convert"), [(64, 32768), (1 << 20, 3), (1 << 20, 32768), (96, 7)])
def test_strided_destinations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: int, convert: int) -> None:
    """Column slices and transposed views go through staging; tiny stages split rows across pieces, tiny
    conversion slices split rows and blocks of rows."""
    monkeypatch.setattr(stream_mod, "STAGE_BYTES", stage)
    monkeypatch.setattr(stream_mod, "CONVERT_ELEMS", convert)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(9, 7, 5, generator=g), torch.randn(6, 11, generator=g)
    save_file({"a": a, "b": b}, str(tmp_path / "model.safetensors"))
    fused = torch.zeros(9, 7, 8)
    bt = torch.zeros(11, 6, dtype=torch.float64)
    plan = {"a": fused[:, :, 2:7], "b": bt.t()}
    assert not plan["a"].is_contiguous() and not plan["b"].is_contiguous()
    load_tensors(CheckpointIndex.open(tmp_path), plan)
    assert _same_bits(fused[:, :, 2:7].contiguous(), a)
    assert torch.count_nonzero(fused[:, :, :2]) == 0 and torch.count_nonzero(fused[:, :, 7:]) == 0
    assert _same_bits(bt.t().contiguous(), b.double())


def test_subset_of_tensors(tmp_path: Path) -> None:
    tensors = sample_tensors()
    write_sharded(tmp_path, tensors, 2)
    index = CheckpointIndex.open(tmp_path)
    plan = {"bf16": torch.empty(33, dtype=torch.bfloat16), "i64": torch.empty(4, 6, dtype=torch.int64)}
    stats = load_tensors(index, plan)
    assert stats.tensors == 2 and stats.bytes_read == 33 * 2 + 24 * 8
    assert _same_bits(plan["bf16"], tensors["bf16"]) and _same_bits(plan["i64"], tensors["i64"])
    # a bare mapping of records works as a source too (what adapters hold)
    again = {"bf16": torch.empty(33, dtype=torch.bfloat16)}
    load_tensors({"bf16": index.tensors["bf16"]}, again)
    assert _same_bits(again["bf16"], tensors["bf16"])


# ------------------------------------------------------------------------------------- plan validation


@pytest.fixture
def ckpt(tmp_path: Path) -> CheckpointIndex:
    save_file({"a": torch.ones(2, 3), "b": torch.ones(4), "c": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    return CheckpointIndex.open(tmp_path)


def _untouched(plan: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isnan(t).all()) for t in plan.values())


def test_missing_tensors_all_named(ckpt: CheckpointIndex) -> None:
    plan = {"a": torch.full((2, 3), float("nan")), "x": torch.empty(1), "y": torch.empty(1)}
    with pytest.raises(TensorMismatch) as info:
        load_tensors(ckpt, plan)
    assert "'x'" in str(info.value) and "'y'" in str(info.value) and "2 planned" in str(info.value)
    assert _untouched({"a": plan["a"]})


def test_misshaped_tensor_named_with_file_and_shapes(ckpt: CheckpointIndex) -> None:
    plan = {"a": torch.full((3, 2), float("nan")), "b": torch.full((4,), float("nan"))}
    with pytest.raises(TensorMismatch) as info:
        load_tensors(ckpt, plan)
    assert info.value.tensor == "a" and info.value.file is not None
    assert "(2, 3)" in str(info.value) and "(3, 2)" in str(info.value)
    assert _untouched(plan)


def test_several_misshaped_tensors_all_named(ckpt: CheckpointIndex) -> None:
    plan = {"a": torch.empty(6), "b": torch.empty(5), "c": torch.empty(1)}
    with pytest.raises(TensorMismatch) as info:
        load_tensors(ckpt, plan)
    assert "'a'" in str(info.value) and "'b'" in str(info.value) and "'c'" not in str(info.value)


def test_inconvertible_dtype(ckpt: CheckpointIndex) -> None:
    with pytest.raises(TensorMismatch, match="cannot be converted"):
        load_tensors(ckpt, {"b": torch.empty(4, dtype=torch.int32)})
    with pytest.raises(TensorMismatch, match="cannot be converted"):
        load_tensors(ckpt, {"b": torch.empty(4, dtype=torch.bool)})


def test_unexpected_tensors(ckpt: CheckpointIndex) -> None:
    plan = {"a": torch.full((2, 3), float("nan"))}
    load_tensors(ckpt, dict(plan), unexpected="ignore")
    plan = {"a": torch.full((2, 3), float("nan"))}
    with pytest.raises(TensorMismatch) as info:
        load_tensors(ckpt, plan, unexpected="error")
    assert "'b'" in str(info.value) and "'c'" in str(info.value)
    assert _untouched(plan)
    with pytest.raises(TensorMismatch) as info:
        load_tensors(ckpt, plan, unexpected="error", ignore_unexpected=["b"])
    assert info.value.tensor == "c"
    load_tensors(ckpt, plan, unexpected="error", ignore_unexpected=["b", "[c-z]"])
    assert torch.equal(plan["a"], torch.ones(2, 3))


def test_file_truncated_after_open_is_caught_before_reading(tmp_path: Path) -> None:
    save_file({"a": torch.ones(100), "b": torch.ones(100)}, str(tmp_path / "model.safetensors"))
    index = CheckpointIndex.open(tmp_path)
    path = tmp_path / "model.safetensors"
    os.truncate(path, path.stat().st_size - 4)
    plan = {"a": torch.full((100,), float("nan")), "b": torch.full((100,), float("nan"))}
    with pytest.raises(HeaderError) as info:
        load_tensors(index, plan)
    assert info.value.file == str(path)
    assert _untouched(plan)


def test_a_failing_reader_thread_stops_the_pool_and_raises_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two files read by two pool workers: the first file ends early (its descriptor is a truncated copy, so only
    the read itself can notice). The EOF error reaches the caller with its file and tensor, the first file's
    complete tensors are filled, and the pool stops: the second file, queued behind, is never read."""
    monkeypatch.setattr(stream_mod, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(stream_mod, "MIN_THREADED_BYTES", 0)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        save_file({f"{name}{i}": torch.ones(1024) for i in range(8)}, str(tmp_path / name / "model.safetensors"))
    files = []
    for name in ("a", "b"):
        index = CheckpointIndex.open(tmp_path / name)
        recs = sorted(index.tensors.values(), key=lambda r: r.start)
        jobs = [Job(r, torch.full(r.shape, float("nan"))) for r in recs]
        path = tmp_path / name / "model.safetensors"
        if name == "a":  # cut inside a3: a0..a2 complete, four whole tensors after the cut
            short = tmp_path / "short.safetensors"
            short.write_bytes(path.read_bytes()[: recs[3].start + 100])
            path = short
        files.append((path, os.open(path, os.O_RDONLY), jobs))
    try:
        with pytest.raises(HeaderError) as info:
            stream_mod.stream_to_host(files, threads=2)
    finally:
        for _, fd, _ in files:
            os.close(fd)
    assert info.value.tensor in {"a3", "a4", "a5", "a6", "a7"}
    assert all(torch.equal(j.dest, torch.ones(1024)) for j in files[0][2][:3])
    assert _untouched({j.record.name: j.dest for j in files[1][2]})


@pytest.mark.slow
def test_real_model_streams_bit_identical(smollm2_dir: Path) -> None:
    """The real SmolLM2 file, fp32 -> bf16 destinations, stream vs load_file."""
    index = CheckpointIndex.open(smollm2_dir)
    ref = load_file(str(smollm2_dir / "model.safetensors"))
    plan = {n: torch.empty(r.shape, dtype=torch.bfloat16) for n, r in index.tensors.items()}
    stats = load_tensors(index, plan, unexpected="error")
    assert stats.tensors == len(ref)
    for n, t in ref.items():
        assert _same_bits(plan[n], t.to(torch.bfloat16)), n


@pytest.mark.gpu
@pytest.mark.parametrize("n_shards", [1, 3])
def test_cuda_bit_identical(tmp_path: Path, n_shards: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.loading import cuda as cuda_mod

    monkeypatch.setattr(cuda_mod, "BUFFER_BYTES", 8192)  # many buffer turns, events exercised
    g = torch.Generator().manual_seed(6)
    tensors = sample_tensors()
    tensors.update({f"w{i}": torch.randn(33, 70, generator=g) for i in range(6)})
    write_sharded(tmp_path, tensors, n_shards)
    ref = _reference(tmp_path)
    index = CheckpointIndex.open(tmp_path)
    plan = {n: _garbage_like(t).cuda() for n, t in ref.items()}
    fused = torch.zeros(6 * 33, 70, device="cuda", dtype=torch.bfloat16)  # converted on device, into views
    for i in range(6):
        plan[f"w{i}"] = fused[i * 33 : (i + 1) * 33]
    strided = torch.zeros(13, 7, device="cuda")
    plan["f32"] = strided.t()
    load_tensors(index, plan)
    torch.cuda.synchronize()
    for n, t in ref.items():
        want = t.to(plan[n].dtype)
        assert _same_bits(plan[n].cpu(), want), n
