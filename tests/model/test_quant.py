"""service.model.weights int8 / int4: constructors, the kernels' layouts, dequantize against the kernels, linear."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from service.model.weights import Int4Weight, Int8Weight, Scratch, linear, quantize

pytestmark = pytest.mark.numerics

# Shapes of each CPU int4 layout case (full 64-row blocks, a 16/32/48-row remainder, both) and of SmolLM2.
SHAPES = [(64, 128), (48, 96), (32, 64), (16, 32), (80, 64), (112, 96), (960, 576), (576, 1536)]


def _kernel_dense(w: Int4Weight | Int8Weight) -> torch.Tensor:
    """The weight as the kernel itself multiplies by it: identity rows through the quantized matmul. [N, K]"""
    return w.matmul(torch.eye(w.shape[1], dtype=w.dtype)).t()


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int4_dequantize_matches_the_kernel_and_the_raw_values(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale = torch.rand(n, k // 32, generator=gen) + 0.05
    zero = torch.randn(n, k // 32, generator=gen)
    w = Int4Weight.from_q_scale_zero(q.to(torch.uint8), scale, zero, 32)
    assert w.shape == (n, k) and w.dtype == torch.float32
    assert torch.equal(w.unpack(), q.to(torch.uint8))
    expected = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    torch.testing.assert_close(w.dequantize(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(_kernel_dense(w), expected, rtol=0, atol=1e-5)
    assert w.nbytes == n * k // 2 + 2 * n * (k // 32) * 4


def test_int8_raw_constructor_is_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (48, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(48, generator=gen)
    w = Int8Weight.from_q_scale(q, scale)
    assert torch.equal(w.dequantize(), q.float() * scale[:, None])
    torch.testing.assert_close(_kernel_dense(w), q.float() * scale[:, None], rtol=1e-6, atol=1e-5)
    assert w.nbytes == 48 * 64 + 48 * 4


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_quantize_error_is_within_half_a_step(group: int) -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    qw = Int4Weight.quantize(w, group)
    step = (w.view(64, -1, group).amax(2) - w.view(64, -1, group).amin(2)) / 15  # [N, K/g]
    err = (qw.dequantize() - w).abs().view(64, -1, group).amax(2)
    assert bool((err <= step / 2 + 1e-5).all())


def test_int8_quantize_error_is_within_half_a_step() -> None:
    w = torch.randn(32, 100, generator=torch.Generator().manual_seed(3))
    qw = Int8Weight.quantize(w)
    step = w.abs().amax(1) / 127  # [N]
    assert bool(((qw.dequantize() - w).abs().amax(1) <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_kernel_and_dense_paths_agree_with_the_dequantized_weight(kind: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    w = quantize(torch.randn(96, 64, generator=gen), kind, 32, dtype=dtype)  # type: ignore[arg-type]
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(2, 5, 64, generator=gen).to(dtype)
    ref = torch.nn.functional.linear(x.float(), w.dequantize(torch.float32), bias.float())
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 0.1}
    kernel = linear(x, w, bias)
    assert kernel.shape == (2, 5, 96) and kernel.dtype == dtype
    torch.testing.assert_close(kernel.float(), ref, **tol)
    scratch = Scratch()
    dense_w = dataclasses.replace(w, dense_from_rows=4)
    dense = linear(x, dense_w, bias, scratch=scratch)
    assert scratch.nbytes == 96 * 64 * dtype.itemsize  # the dense path ran, in the reused buffer
    torch.testing.assert_close(dense.float(), ref, **tol)
    assert linear(x[:, :1], dense_w, bias, scratch=scratch).shape == (2, 1, 96)  # 2 rows < 4: the kernel


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Int4Weight.quantize(torch.randn(40, 64)), "divisible by 16"),
        (lambda: Int4Weight.quantize(torch.randn(32, 48)), "divisible by group_size"),
        (lambda: Int4Weight.quantize(torch.randn(32, 64), 16), "group_size must be one of"),
        (
            lambda: Int4Weight.from_q_scale_zero(
                torch.full((16, 32), 16, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1), 32
            ),
            "0..15",
        ),
        (
            lambda: Int4Weight.from_q_scale_zero(
                torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2), 32
            ),
            r"\[16, 1\]",
        ),
        (lambda: Int8Weight.from_q_scale(torch.zeros(4, 4, dtype=torch.int16), torch.ones(4)), "int8"),
        (lambda: Int8Weight.from_q_scale(torch.zeros(4, 4, dtype=torch.int8), torch.ones(3)), r"\[4\]"),
        (lambda: quantize(torch.randn(16, 32), "int2"), "int8' or 'int4"),  # type: ignore[arg-type]
    ],
)
def test_bad_inputs_are_refused_by_name(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]
