"""loraplex's compiled kernels (``service.kernels.native``) against float64 references, and how they are built.

The variant under test follows torch's capability, so the numerics rerun under ``ATEN_CPU_CAPABILITY=default`` /
``avx2`` proves the generic and AVX2 builds as the default run proves the machine's best. The references are
computed from the raw numbers (q, d, m) in float64, never through the weights' own unpack.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from support.native import compiled_kernels, kernels_mode

from service.errors import FailedPrecondition
from service.kernels import native
from service.model.weights import Scratch, linear
from service.model.weights.protocol import native_dense_rows
from service.model.weights.q4_native import Q4Native

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 2, 3, 4, 5, 9]  # every register-block width (1..4; 1 row takes two tiles at once) and passes beyond


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


def _q4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.005
    m = torch.randn(n, k // 32, generator=gen) * 0.05
    return q, d, m


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]  # one output rounding


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_q4_kernel_matches_a_float64_reference(dtype: torch.dtype, rows: int) -> None:
    kern = compiled_kernels()
    q, d, m = _q4(80, 96, seed=rows)  # 80 output rows: five OpenMP work items of 16
    w = Q4Native.from_q_d_m(q, d, m, kern, dtype=dtype)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(7)).to(dtype)
    truth = q.double() * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)
    y = w.matmul(x)
    assert y.dtype == dtype and y.shape == (rows, 80)
    assert _rel(y, x.double() @ truth.t()) < _tolerance(dtype)


@pytest.mark.numerics
@pytest.mark.parametrize("n", [1, 15, 37])
def test_q4_kernel_pads_a_partial_tile_and_writes_only_the_rows_asked(n: int) -> None:
    kern = compiled_kernels()
    q, d, m = _q4(n, 64, seed=n)
    w = Q4Native.from_q_d_m(q, d, m, kern, dtype=torch.float32)
    assert w.shape == (n, 64) and w.qs.shape[0] == -(-n // 16)
    assert torch.equal(w.unpack(), q.to(torch.uint8))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(n))
    truth = q.double() * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)
    assert _rel(w.matmul(x), x.double() @ truth.t()) < _tolerance(torch.float32)


@pytest.mark.numerics
def test_a_rows_products_are_bit_identical_whatever_the_batch_beside_it() -> None:
    """Each row's Q4 and Q8 products take the same operations in the same order at every batch size and place in
    the batch (the register blocks only share the weights' conversion), so a batch never changes a row's logits."""
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(11)
    q, d, m = _q4(80, 96, seed=11)
    w = Q4Native.from_q_d_m(q, d, m, kern, dtype=torch.float32)
    q8 = torch.randint(-128, 128, (3, 523, 32), generator=gen, dtype=torch.int8)
    d8 = torch.rand(3, 523, generator=gen) * 0.01
    x = torch.randn(33, 96, generator=gen)
    alone4 = torch.cat([w.matmul(x[i : i + 1]) for i in range(33)])
    alone8 = torch.cat([kern.q8_matmul(x[i : i + 1], q8, d8, torch.float32) for i in range(33)])
    for start, rows in ((0, 33), (0, 5), (3, 9), (7, 17), (29, 4)):
        part = x[start : start + rows]
        assert torch.equal(w.matmul(part), alone4[start : start + rows]), (start, rows)
        assert torch.equal(kern.q8_matmul(part, q8, d8, torch.float32), alone8[start : start + rows]), (start, rows)


@pytest.mark.numerics
@pytest.mark.parametrize(("x_dtype", "d_dtype"), [(t, t) for t in DTYPES] + [(torch.float32, torch.float16)], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_q8_kernel_matches_a_float64_reference(x_dtype: torch.dtype, d_dtype: torch.dtype, rows: int) -> None:
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(rows)
    vocab, k = 523, 64  # not a multiple of the register blocks (4 rows, 2 at 4 rows of x) nor the 256-row work item
    q = torch.randint(-128, 128, (k // 32, vocab, 32), generator=gen, dtype=torch.int8)
    d = (torch.rand(k // 32, vocab, generator=gen) * 0.01).to(d_dtype)
    x = torch.randn(rows, k, generator=gen).to(x_dtype)
    table = (q.double() * d.double()[..., None]).transpose(0, 1).reshape(vocab, k)
    y = kern.q8_matmul(x, q, d, x_dtype)
    assert y.shape == (rows, vocab)
    assert _rel(y, x.double() @ table.t()) < _tolerance(x_dtype)


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("dtype", "out_dtype"), [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)], ids=str
)
@pytest.mark.parametrize("rows", ROWS)
def test_dense_kernel_matches_a_float64_reference_and_is_batch_invariant(
    dtype: torch.dtype, out_dtype: torch.dtype, rows: int
) -> None:
    """x @ W^T for a dense W as stored (K not a multiple of the 16 lanes, N not of the weight block), each row's
    result bit-identical alone and in the batch; ``linear`` takes it up to ``native_dense_rows`` rows."""
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 203, generator=gen).to(dtype), torch.randn(37, 203, generator=gen).to(dtype)
    y = kern.dense_matmul(x, w, out_dtype)
    assert y.dtype == out_dtype and y.shape == (rows, 37)
    assert _rel(y, x.double() @ w.double().t()) < _tolerance(out_dtype)
    alone = torch.cat([kern.dense_matmul(x[i : i + 1], w, out_dtype) for i in range(rows)])
    assert torch.equal(y, alone)
    if dtype == out_dtype:  # linear: the kernel up to native_dense_rows rows, torch's GEMM beyond
        want = y if rows <= native_dense_rows(dtype, kern) else torch.nn.functional.linear(x, w)
        assert torch.equal(linear(x, w, native=kern), want)
    with pytest.raises(ValueError, match="dense_matmul"):
        kern.dense_matmul(x, w[:, :-1].contiguous(), out_dtype)


def _dense_in_lanes(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """lp_dense_matmul's order, in float32 torch ops: 16 lanes (lane l sums k = l, l + 16, ... in turn, each
    product rounded, then added), the lanes pairwise (l + 8, then + 4, + 2, + 1), then the tail in order."""
    x, w = x.float(), w.float()
    body = x.shape[1] - x.shape[1] % 16
    acc = torch.zeros(x.shape[0], w.shape[0], 16)
    for c in range(0, body, 16):
        acc = acc + x[:, None, c : c + 16] * w[None, :, c : c + 16]
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half : 2 * half]
    out = acc[..., 0]
    for c in range(body, x.shape[1]):
        out = out + x[:, None, c] * w[None, :, c]
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_kernel_sums_in_one_order_on_every_instruction_set(dtype: torch.dtype) -> None:
    """Bit-equal to its order written in torch: so avx512, avx2 and generic (the capability reruns) agree bit for
    bit, at one row (a weight row at a time) and at several (blocks of rows)."""
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 75, generator=gen).to(dtype), torch.randn(13, 75, generator=gen).to(dtype)
    assert torch.equal(kern.dense_matmul(x, w, torch.float32), _dense_in_lanes(x, w))
    assert torch.equal(kern.dense_matmul(x[:1], w, torch.float32), _dense_in_lanes(x[:1], w))


@pytest.mark.numerics
def test_q4_weight_dequantizes_its_values_and_every_linear_path_agrees() -> None:
    kern = compiled_kernels()
    q, d, m = _q4(48, 64, seed=3)
    w = Q4Native.from_q_d_m(q, d, m, kern, dtype=torch.float32)
    assert torch.equal(w.unpack(), q.to(torch.uint8))
    truth = q.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    torch.testing.assert_close(w.dequantize(), truth, rtol=0, atol=1e-7)
    x = torch.randn(6, 64)
    kernel = linear(x, w)  # 6 rows: the kernel
    scratch = linear(x, w.with_dispatch(1), scratch=Scratch())  # dequantized into the scratch buffer
    copy = w.with_dense_copy()
    assert copy.dense is not None and copy.nbytes == w.nbytes + 48 * 64 * 4
    torch.testing.assert_close(kernel, scratch, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(linear(x, copy.with_dispatch(1)), scratch, rtol=1e-5, atol=1e-6)
    same = Q4Native.from_q_scale_zero(q, d, m + 8 * d, kern, dtype=torch.float32)  # Int4Rows' terms
    torch.testing.assert_close(same.dequantize(), w.dequantize(), rtol=0, atol=1e-6)


def test_bad_blocks_are_refused_by_name() -> None:
    kern = compiled_kernels()
    q, d, m = _q4(16, 64, seed=1)
    with pytest.raises(ValueError, match=r"q values must be in 0\.\.15"):
        Q4Native.from_q_d_m(q + 1, d, m, kern, dtype=torch.float32)
    with pytest.raises(ValueError, match="d and m must be"):
        Q4Native.from_q_d_m(q, d[:, :1], m, kern, dtype=torch.float32)
    w = Q4Native.from_q_d_m(q, d, m, kern, dtype=torch.float32)
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        w.matmul(torch.randn(64, 3).t())


def test_a_built_library_is_reused_and_replaces_an_older_sources(tmp_path: Path) -> None:
    compiled_kernels()  # a compiler is here
    isa = native.isa_for("DEFAULT", None)
    (tmp_path / f"blocks-{isa}-0000000000000000.so").write_bytes(b"an older source's build")
    first = native.build(isa, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build(isa, tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    with kernels_mode("native", tmp_path):
        loaded = native.kernels()
        assert loaded is not None and loaded.path.parent == tmp_path
        assert str(tmp_path) in native.status() and native.variant() == loaded.isa


def test_a_source_that_does_not_compile_fails_by_name_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every source compiles in its own process (in parallel), then one link: one failing source fails the build
    with the compiler's message, and neither objects nor a half-written library stay in the cache."""
    compiled_kernels()
    broken = tmp_path / "src" / "broken.cpp"
    broken.parent.mkdir()
    broken.write_text("int lp_broken() { return undeclared_name; }\n")
    monkeypatch.setattr(native, "SOURCES", (*native.SOURCES, broken))
    cache = tmp_path / "cache"
    with pytest.raises(FailedPrecondition, match=r"(?s)building the generic kernels failed: .*undeclared_name"):
        native.build(native.isa_for("DEFAULT", None), cache)
    assert not list(cache.iterdir())


def test_no_compiler_serves_eager_with_a_warning_and_native_mode_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with kernels_mode("auto", tmp_path), caplog.at_level(logging.WARNING, logger="service.kernels.native"):
        assert native.kernels() is None
        assert "no C++ compiler" in native.status()
        assert any("native_kernels_unavailable" in r.getMessage() for r in caplog.records)
    with kernels_mode("native", tmp_path), pytest.raises(FailedPrecondition, match="--kernels native: no C"):
        native.kernels()
    with kernels_mode("eager", tmp_path):
        assert native.kernels() is None and native.status() == "off (--kernels eager)"
        assert native.variant() == "eager"
    assert not list(tmp_path.iterdir())  # nothing was built


def test_variants_follow_torchs_capability() -> None:
    assert native.isa_for("AVX512", frozenset({"avx512f"})) == "avx512"
    assert native.isa_for("AVX2", frozenset({"avx2", "f16c"})) == "avx2"
    assert native.isa_for("AVX2", None) == "generic"  # flags unreadable: no assumption
    assert native.isa_for("DEFAULT", frozenset({"avx2", "f16c"})) == "generic"
    assert native.isa_for("ZVECTOR", None) == "generic"


def test_the_kernels_command_builds_every_variant_for_an_image(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`loraplex kernels --cache DIR` (the image's build step): each variant, then loaded there with no compiler."""
    from service.cli import main

    compiled_kernels()
    assert main(["kernels", "--cache", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == list(native.ISA_FLAGS)
    assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir()) == sorted(native.ISA_FLAGS)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # a runtime image has none
    with kernels_mode("native", tmp_path):
        loaded = native.kernels()
        assert loaded is not None and loaded.path.parent == tmp_path
