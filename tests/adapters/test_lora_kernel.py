"""The compiled batched-LoRA kernel (``NativeKernels.lora_delta``, ``src/lora.cpp``) against a float64 reference.

Tables as the batch lays them out: A [G, R, in] (also given as a strided view of rank-minor storage), per module
Bt [G, r, out_m], a DoRA scale and a trained bias on some modules; mixed ranks, modules some groups lack (zeros),
a group with no row, rows with no adapter inside the span, one row, several tokens a row. The reference is computed
in float64 from the tables as stored. Isolation and batch invariance are checked bit for bit: a NaN adapter reaches
only its own rows, and a row's result does not depend on its neighbours, its place or A's strides. bf16 inputs on
bf16 tables follow one order of sums written out in torch ops (``_in_pairs``), bit for bit on every instruction set.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support.native import compiled_kernels
from torch import Tensor

from service.kernels.lora import LoraSegment, LoraSite, lora_site
from service.kernels.native import NativeKernels

pytestmark = pytest.mark.numerics

IN, RANKS, OUTS = 80, (8, 3, 16), (64, 40, 100)  # 80 inputs: five lanes of 16; 100 columns: a partial block
COLS = sum(OUTS) + 6  # columns past the modules' stay untouched
DTYPES = [torch.float32, torch.bfloat16]


class Tables:
    """Random tables of ``groups`` adapters; group 1 lacks the second module (zeros), as a batch stacks it."""

    def __init__(self, groups: int, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.a = (torch.randn(groups, sum(RANKS), IN, generator=gen) / math.sqrt(IN)).to(dtype)  # [G, R, in]
        self.bt = [
            (torch.randn(groups, r, n, generator=gen) / math.sqrt(r)).to(dtype)
            for r, n in zip(RANKS, OUTS, strict=True)
        ]  # [G, r_m, out_m] per module
        self.a[1, RANKS[0] : RANKS[0] + RANKS[1]] = 0
        self.bt[1][1] = 0
        self.scale = torch.rand(groups, OUTS[1], generator=gen) + 0.5  # DoRA on the second module
        self.bias = torch.randn(groups, OUTS[2], generator=gen).to(dtype)  # a trained bias on the third

    def segments(self) -> list[LoraSegment]:
        starts, cols = [0, RANKS[0], RANKS[0] + RANKS[1]], [0, OUTS[0], OUTS[0] + OUTS[1]]
        extras: list[tuple[Tensor | None, Tensor | None]] = [(None, None), (self.scale, None), (None, self.bias)]
        return [
            LoraSegment(start, col, bt, scale, bias)
            for start, col, bt, (scale, bias) in zip(starts, cols, self.bt, extras, strict=True)
        ]

    def site(self, k: NativeKernels, layout: str) -> LoraSite:
        """``layout`` "rows": A's rows contiguous, as the tables store them; "strided": the same values stored
        [G, in, R] and passed as a transposed view (the kernel gathers each row)."""
        a = self.a if layout == "rows" else self.a.transpose(1, 2).contiguous().transpose(1, 2)
        return lora_site(a, self.segments())

    def reference(self, out: Tensor, x: Tensor, group: list[int]) -> Tensor:
        """float64 ``out`` with every grouped row's delta applied."""
        ref = out.double().clone()
        for row, g in enumerate(group):
            if g < 0:
                continue
            h = x[row].double() @ self.a[g].double().t()  # [T, R]
            for seg in self.segments():
                r, n = seg.bt.shape[1:]
                d = h[:, seg.start : seg.start + r] @ seg.bt[g].double()
                if seg.bias is not None:
                    d += seg.bias[g].double()
                cols = ref[row, :, seg.col : seg.col + n]
                cols.copy_(cols + d if seg.scale is None else (cols + d) * seg.scale[g].double())
        return ref


def _inputs(rows: int, t: int, dtype: torch.dtype, seed: int = 1) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, t, IN, generator=gen).to(dtype), torch.randn(rows, t, COLS, generator=gen).to(dtype)


def _run(k: NativeKernels, site: LoraSite, out: Tensor, x: Tensor, group: list[int]) -> Tensor:
    got = out.clone()
    k.lora_delta(site, got, x, torch.tensor(group, dtype=torch.int64))
    return got


@pytest.mark.parametrize("layout", ["rows", "strided"])
@pytest.mark.parametrize("tables_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", [1, 3])
def test_kernel_matches_a_float64_reference(layout: str, tables_dtype: torch.dtype, dtype: torch.dtype, t: int) -> None:
    k = compiled_kernels()
    tables = Tables(5, tables_dtype)  # group 3 has no row
    group = [2, -1, 0, 2, 4, -1, 1, 0, 2]  # rows without an adapter inside the span
    x, out = _inputs(len(group), t, dtype)
    got = _run(k, tables.site(k, layout), out, x, group)
    ref = tables.reference(out, x, group)
    delta = (ref - out.double()).abs().max()
    tol = 2e-6 if dtype == torch.float32 else 8e-3  # float32 sums; bfloat16: the one rounding of the output
    assert float((got.double() - ref).abs().max()) <= tol * float(ref.abs().max())
    assert delta > 0.1  # the deltas are not negligible next to the outputs
    for row, g in enumerate(group):
        if g < 0:
            assert torch.equal(got[row], out[row]), f"row {row} has no adapter and must stay as it was"
    assert torch.equal(got[..., sum(OUTS) :], out[..., sum(OUTS) :]), "columns past the modules stay untouched"


def _in_pairs(tables: Tables, out: Tensor, x: Tensor, group: list[int]) -> Tensor:
    """lp_lora_delta's arithmetic for bf16 x on bf16 tables in float32 torch ops. h: per row of A, lane l of each
    chunk of 32 inputs adds the product of input 2 l + 1, then of 2 l (the last chunk padded with zeros), the 16
    lanes summed pairwise (l + 8, + 4, + 2, + 1). Per module and column: 0 + the rank's products in order, + bias,
    added to out in float32 (then times the DoRA scale) and rounded once to bf16."""
    ref = out.float().clone()
    t = x.shape[1]
    for row, g in enumerate(group):
        if g < 0:
            continue
        pad = -IN % 32
        xp = F.pad(x[row].float(), (0, pad)).view(t, 1, -1, 16, 2)
        ap = F.pad(tables.a[g].float(), (0, pad)).view(1, sum(RANKS), -1, 16, 2)
        acc = torch.zeros(t, sum(RANKS), 16)
        for c in range(xp.shape[2]):
            acc = acc + xp[:, :, c, :, 1] * ap[:, :, c, :, 1]
            acc = acc + xp[:, :, c, :, 0] * ap[:, :, c, :, 0]
        for w in (8, 4, 2, 1):
            acc = acc[..., :w] + acc[..., w : 2 * w]
        h = acc[..., 0]  # [T, R]
        for seg in tables.segments():
            r, n = seg.bt.shape[1:]
            d = torch.zeros(t, n)
            for q in range(r):
                d = d + h[:, seg.start + q, None] * seg.bt[g][q].float()
            if seg.bias is not None:
                d = d + seg.bias[g].float()
            cols = ref[row, :, seg.col : seg.col + n]
            cols.copy_(cols + d if seg.scale is None else (cols + d) * seg.scale[g])
    return ref.to(out.dtype)


@pytest.mark.parametrize("layout", ["rows", "strided"])
@pytest.mark.parametrize("t", [1, 3])
def test_bf16_on_bf16_tables_sums_in_pairs_on_every_instruction_set(layout: str, t: int) -> None:
    k = compiled_kernels()
    tables = Tables(5, torch.bfloat16)
    group = [2, -1, 0, 2, 4, -1, 1, 0, 2]
    x, out = _inputs(len(group), t, torch.bfloat16)
    assert torch.equal(_run(k, tables.site(k, layout), out, x, group), _in_pairs(tables, out, x, group))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_row_and_no_row(dtype: torch.dtype) -> None:
    k = compiled_kernels()
    tables = Tables(3, dtype)
    site = tables.site(k, "rows")
    x, out = _inputs(1, 1, dtype)
    got = _run(k, site, out, x, [2])
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    ref = tables.reference(out, x, [2])
    assert float((got.double() - ref).abs().max()) <= tol * float(ref.abs().max())
    assert torch.equal(_run(k, site, out, x, [-1]), out)


@pytest.mark.parametrize("layout", ["rows", "strided"])
@pytest.mark.parametrize("where", ["a", "bt", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_nan_adapter_reaches_only_its_own_rows(layout: str, where: str, dtype: torch.dtype) -> None:
    k = compiled_kernels()
    healthy, broken = Tables(4, dtype), Tables(4, dtype)
    {"a": broken.a, "bt": broken.bt[0], "bias": broken.bias}[where][2].fill_(math.nan)
    group = [0, 2, -1, 1, 2, 3, 0]
    x, out = _inputs(len(group), 2, dtype)
    want = _run(k, healthy.site(k, layout), out, x, group)
    got = _run(k, broken.site(k, layout), out, x, group)
    for row, g in enumerate(group):
        if g == 2:
            assert not torch.isfinite(got[row]).all()
        else:
            assert torch.equal(got[row], want[row]), f"row {row} (group {g}) changed because of group 2"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_result_does_not_depend_on_its_batch_or_the_layout(dtype: torch.dtype) -> None:
    """Bit for bit: a row alone, among others (its own group's and other groups' rows, before and after it), and
    with A's rows gathered from strided storage."""
    k = compiled_kernels()
    tables = Tables(5, dtype)
    rows, strided = tables.site(k, "rows"), tables.site(k, "strided")
    x, out = _inputs(8, 3, dtype)
    alone = _run(k, rows, out[5:6], x[5:6], [3])
    for group in ([0, 1, 2, 4, -1, 3, 1, 0], [3, 3, 3, 3, 3, 3, 3, 3], [-1, -1, -1, -1, -1, 3, -1, -1]):
        for site in (rows, strided):
            assert torch.equal(_run(k, site, out, x, group)[5], alone[0]), group
    many = torch.randn(64, 3, IN, generator=torch.Generator().manual_seed(9)).to(dtype)  # another thread's share
    many[37] = x[5]
    wide = torch.zeros(64, 3, COLS, dtype=dtype)
    wide[37] = out[5]
    groups = [i % 5 for i in range(64)]  # 37 is one of group 3's thirteen rows, in the middle of the call
    groups[37] = 3
    assert torch.equal(_run(k, rows, wide, many, groups)[37], alone[0])


def test_refusals() -> None:
    k = compiled_kernels()
    tables = Tables(3, torch.float32)
    site = tables.site(k, "rows")
    x, out = _inputs(2, 1, torch.float32)
    with pytest.raises(ValueError, match="lp_lora_delta refused"):
        k.lora_delta(site, out, x, torch.tensor([0, 3]))  # no group 3
    with pytest.raises(ValueError, match="lora_delta"):
        k.lora_delta(site, out.bfloat16(), x, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="lora_delta"):
        k.lora_delta(site, out[..., :100], x, torch.tensor([0, 1]))  # narrower than the modules' columns
    with pytest.raises(ValueError, match="lora_site"):
        lora_site(tables.a, [LoraSegment(0, 0, tables.bt[0].bfloat16())])
