"""bf16 weights in pairs (``Bf16Pairs``, ``lp_pairs_matmul``): the layout, the order of the sums, and the load.

The kernel's arithmetic is written out in torch ops below (``_in_pairs``) and the kernel must equal it bit for bit:
on a CPU with bf16 dot products that proves the instruction path, under the ``ATEN_CPU_CAPABILITY`` reruns (the
avx2 and generic builds, which have no such path) the portable code, so every variant gives the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.native import compiled_kernels, kernels_mode

from service.model import KVCache
from service.model.load_folder import load_model
from service.model.weights import Scratch, linear
from service.model.weights.bf16_pairs import Bf16Pairs, PairsTable, pairs_wanted
from service.selfcheck import run_self_check

SHAPES = [(1, 75, 13), (3, 64, 16), (4, 203, 37), (5, 33, 100), (9, 96, 50), (13, 1, 17)]  # (M, K, N)


def _in_pairs(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """lp_pairs_matmul's order in float32 torch ops: per output one sum over the input pairs in order, pair p adding
    the product of inputs 2 p + 1, then of 2 p (an odd K's last pair with a zero)."""
    k = x.shape[1]
    x, w = F.pad(x.float(), (0, k % 2)), F.pad(w.float(), (0, k % 2))
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range(x.shape[1] // 2):
        acc = acc + x[:, None, 2 * p + 1] * w[None, :, 2 * p + 1]
        acc = acc + x[:, None, 2 * p] * w[None, :, 2 * p]
    return acc


@pytest.mark.numerics
@pytest.mark.parametrize(("m", "k", "n"), SHAPES, ids=str)
def test_pairs_sum_in_one_order_on_every_instruction_set(m: int, k: int, n: int) -> None:
    """Bit-equal to the order written in torch, in float32 and rounded to bf16, each row alike alone and in the
    batch; and within one bf16 rounding of float64."""
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x, w = (torch.randn(rows, k, generator=gen).to(torch.bfloat16) for rows in (m, n))
    weight = Bf16Pairs.pack(w, kern)
    want = _in_pairs(x, w)
    got = kern.pairs_matmul(x, weight.packed, n, torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(kern.pairs_matmul(x, weight.packed, n, torch.bfloat16), want.bfloat16())
    assert torch.equal(torch.cat([kern.pairs_matmul(x[i : i + 1], weight.packed, n, torch.float32) for i in range(m)]),
                       got)  # fmt: skip
    ref = x.double() @ w.double().t()
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_pairs_keep_the_weight_exactly_and_every_path_agrees() -> None:
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(37, 203, generator=gen).to(torch.bfloat16)
    weight = Bf16Pairs.pack(w, kern)
    assert weight.shape == (37, 203) and weight.packed.shape == (3, 102, 16, 2)
    assert torch.equal(weight.dequantize(), w)
    assert torch.equal(weight.dequantize(torch.float32), w.float())
    assert torch.equal(Bf16Pairs.pack(w.float(), kern).packed, weight.packed)  # float32 in: rounded to bf16 first
    x = torch.randn(600, 203, generator=gen).to(torch.bfloat16)
    kernel = linear(x, weight)  # every row count on the kernel
    assert torch.equal(kernel, kern.pairs_matmul(x, weight.packed, 37, torch.bfloat16))
    dense = linear(x, weight.with_dispatch(1), scratch=Scratch())  # the self-check's fallback: dequantized + GEMM
    torch.testing.assert_close(dense, F.linear(x, w))
    copy = weight.with_dense_copy()
    assert copy.dense is not None and copy.nbytes == weight.nbytes + 37 * 203 * 2


def test_pairs_refuse_what_does_not_fit() -> None:
    kern = compiled_kernels()
    w = Bf16Pairs.pack(torch.randn(20, 8).to(torch.bfloat16), kern)
    x = torch.randn(2, 8).to(torch.bfloat16)
    for bad in (x.float(), x[:, :6].contiguous(), x.t().contiguous()):
        with pytest.raises(ValueError, match="pairs_matmul"):
            kern.pairs_matmul(bad, w.packed, 20, torch.bfloat16)
    with pytest.raises(ValueError, match="pairs_matmul"):
        kern.pairs_matmul(x, w.packed, 40, torch.bfloat16)  # rows the blocks do not hold
    with pytest.raises(ValueError, match="pairs_matmul"):
        kern.pairs_matmul(x, w.packed, 20, torch.float16)
    with pytest.raises(ValueError, match="2-D floating"):
        Bf16Pairs.pack(torch.zeros(4, 4, dtype=torch.int32), kern)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_bf16_model_keeps_its_projections_in_pairs_where_the_kernels_outrun_torch(
    tiny_llama_factory: Callable[..., Path], tied: bool
) -> None:
    """Loaded in pairs only where ``pairs_wanted`` (bf16, CPU, the kernels' dot products or the avx2 build), or when
    asked, the head (and a tied embedding) too; the logits are the dense model's within bf16 rounding, and the
    start-up self-check passes on the pairs."""
    kern = compiled_kernels()
    folder = tiny_llama_factory(seed=9, tie_word_embeddings=tied)
    assert not pairs_wanted(torch.float32, torch.device("cpu"), kern)
    assert not pairs_wanted(torch.bfloat16, torch.device("cpu"), None)
    wanted = kern.bf16_dot or kern.isa == "avx2"  # the avx2 build's portable pairs outrun torch's bf16 GEMM there
    assert pairs_wanted(torch.bfloat16, torch.device("cpu"), kern) == wanted
    with kernels_mode("auto"):
        auto = load_model(folder, dtype=torch.bfloat16, device="cpu")[0]
        paired = load_model(folder, dtype=torch.bfloat16, device="cpu", pairs=True)[0]
        dense = load_model(folder, dtype=torch.bfloat16, device="cpu", pairs=False)[0]
        f32 = load_model(folder, dtype=torch.float32, device="cpu", pairs=True)[0]
    assert isinstance(auto.projection(0, "w13"), Bf16Pairs) == wanted
    assert isinstance(paired.projection(1, "w2"), Bf16Pairs) and not isinstance(f32.projection(0, "wo"), Bf16Pairs)
    for layer in range(dense.cfg.num_layers):
        for name in ("wqkv", "wo", "w13", "w2"):
            w = paired.projection(layer, name)
            assert isinstance(w, Bf16Pairs) and torch.equal(w.dequantize(), dense.projection(layer, name))
    table, head = paired.lm_head, dense.lm_head
    assert isinstance(table, PairsTable) and isinstance(head, torch.Tensor)
    assert (paired.tok_embeddings is table) == tied  # tied: one table, in pairs; untied: the embedding stays dense
    if not tied:
        assert torch.equal(paired.tok_embeddings, dense.tok_embeddings)
    every = torch.arange(dense.cfg.vocab_size)
    assert torch.equal(table.gather(every.view(2, -1)).view(-1, table.shape[1]), head)
    assert torch.equal(table.dequantize(), head) and torch.equal(table.rows(every[:5]), head[:5].float())
    h = torch.randn(3, dense.cfg.hidden_size).to(torch.bfloat16)
    assert torch.equal(table.project(h), _in_pairs(h, head))  # float32 logits, as summed
    assert paired.parameter_bytes >= dense.parameter_bytes
    tokens = torch.randint(0, dense.cfg.vocab_size, (3, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6).expand(3, 6)
    logits = []
    for model in (paired, dense):
        cache = KVCache(model.cfg, 3, 8, dtype=model.dtype, device=torch.device("cpu"))
        logits.append(model.logits(model(tokens, pos, cache, 0)).float())
    assert float((logits[0] - logits[1]).abs().max() / logits[1].abs().max()) < 0.03  # a few bf16 roundings
    report = run_self_check(paired)
    pairs_checks = [c for c in report.checks if "bf16-pairs projection" in c.path]
    assert pairs_checks and all(c.status == "ok" for c in report.checks)
    assert table.drop_fast_path(1) and "kept copy" in table.kernel_for(1)  # the self-check's fallback: torch's GEMM
    assert torch.equal(table.project(h), F.linear(h, head))
    assert not table.drop_fast_path(1)
