"""The fused step ops (``src/step.cpp`` through ``service.model.step``) against float64 references and against the
eager path they replace, in float32 and in bfloat16.

Kernel by kernel: RoPE and the K/V write are bit-identical to ``apply_rope`` + ``finite_kv``; attention, RMSNorm and
SiLU·mul agree with float64 within float32 rounding; a row's non-finite values stay in its own output and its cache
slot keeps only bounded values; what lies past a row's position is never read. Then a tiny Llama loaded twice, fused
and eager (``--kernels eager``), decodes the same batch to the same tokens and near-equal hidden states. In bfloat16
the K/V written are bit-identical to eager bf16 RoPE + ``finite_kv`` (every product and sum rounded to bf16 where
torch rounds), and each op's output is within one bf16 rounding of float64. The transformers and PEFT exactness
suites run on the fused path, the default wherever the kernels build.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.native import compiled_kernels, kernels_mode
from support.tiny_models import load_ours

from service.model import KVCache
from service.model.kv_cache import KV_LIMIT, finite_kv
from service.model.rope import apply_rope, rope_table

pytestmark = pytest.mark.numerics

H, KV, D, MAX_LEN = 9, 3, 64, 40


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    return rope_table(inv_freq, MAX_LEN, dtype=torch.float32, device=torch.device("cpu"))


def _attend64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [H, D], k / v [KV, n, D] -> [H * D] in float64, GQA by repeating each KV head H / KV times."""
    k, v = k.double().repeat_interleave(H // KV, 0), v.double().repeat_interleave(H // KV, 0)
    scores = (q.double()[:, None, :] * k).sum(-1) / math.sqrt(D)  # [H, n]
    return (scores.softmax(-1)[:, :, None] * v).sum(1).reshape(-1)


def test_decode_attention_writes_the_eager_kv_and_attends_up_to_each_row_position() -> None:
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(3)
    pos = torch.tensor([7, 30, 0, 39])  # the first position, a middle one, the cache's last
    b = len(pos)
    qkv = torch.randn(b, H + 2 * KV, D, generator=gen)
    qkv[1, H] = qkv[1, H] * 1e6  # a huge K head: bounded in the cache
    data = torch.randn(2, b + 2, KV, MAX_LEN, D, generator=gen)  # slots 1..b run; the others must stay untouched
    for r, p in enumerate(pos.tolist()):
        data[:, 1 + r, :, p + 1 :] = math.nan  # past each row's position: never read
    want = data.clone()
    cos_t, sin_t = _tables()
    cos, sin = cos_t[pos], sin_t[pos]  # [B, D]
    qk = apply_rope(qkv[:, None, : H + KV], cos[:, None, None], sin[:, None, None])[:, 0]  # [B, H + KV, D]
    for r, p in enumerate(pos.tolist()):
        want[0, 1 + r, :, p] = finite_kv(qk[r, H:])
        want[1, 1 + r, :, p] = finite_kv(qkv[r, H + KV :])
    out = kern.decode_attention(qkv, cos, sin, pos, data[0].narrow(0, 1, b), data[1].narrow(0, 1, b), H)
    assert torch.equal(data.nan_to_num(7.0), want.nan_to_num(7.0))  # bit-identical writes, nothing else touched
    assert data[0, 2, 0, 30].abs().max() == KV_LIMIT  # the huge K head, clamped
    for r, p in enumerate(pos.tolist()):
        ref = _attend64(qk[r, :H], want[0, 1 + r, :, : p + 1], want[1, 1 + r, :, : p + 1])
        assert float((out[r].double() - ref).abs().max()) < 2e-6 * max(1.0, float(ref.abs().max())), r


@pytest.mark.parametrize("shared", [True, False], ids=["one-tree", "a-tree-a-slot"])
def test_decode_attention_of_a_draft_tree_sees_the_cache_below_its_root_and_the_nodes_it_marks(shared: bool) -> None:
    """Two slots of a 5-node tree each, token-major: node i at its root's position L + i (RoPE at L + depth), seeing
    positions below L and the nodes its row of the mask marks, nothing else (NaN everywhere it must not read)."""
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(8)
    parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 0]]  # slot 1's tree is a chain and a sibling when one a slot
    marks = torch.zeros(2, 5, 5, dtype=torch.bool)
    for s, tree in enumerate(parents if not shared else [parents[0]] * 2):
        for i in range(5):
            j = i
            while j >= 0:
                marks[s, i, j], j = True, tree[j]
    roots, t = torch.tensor([6, 30]), 5
    pos = (roots[None, :] + torch.arange(t)[:, None]).reshape(-1)  # [T S] token-major
    depth = marks.sum(-1) - 1  # [S, T]
    qkv = torch.randn(t * 2, H + 2 * KV, D, generator=gen)
    data = torch.randn(2, 2, KV, MAX_LEN, D, generator=gen)
    for s in range(2):
        data[:, s, :, roots[s] + t :] = math.nan  # past the last node: never read
    cos_t, sin_t = _tables()
    rope_at = (roots[None, :] + depth.t()).reshape(-1)  # [T S]
    out = kern.decode_attention(qkv, cos_t[rope_at], sin_t[rope_at], pos, data[0], data[1], H, slots=2,
                                tree=marks[:1] if shared else marks)  # fmt: skip
    qk = apply_rope(qkv[:, None, : H + KV], cos_t[rope_at][:, None, None], sin_t[rope_at][:, None, None])[:, 0]
    for r in range(t * 2):
        s, i, root = r % 2, r // 2, int(roots[r % 2])
        assert torch.equal(data[0, s, :, root + i], finite_kv(qk[r, H:]))  # written at L + i
        seen = list(range(root)) + [root + u for u in range(t) if marks[0 if shared else s, i, u]]
        ref = _attend64(qk[r, :H], data[0, s][:, seen], data[1, s][:, seen])
        assert float((out[r].double() - ref).abs().max()) < 2e-6 * max(1.0, float(ref.abs().max())), r
    with pytest.raises(ValueError, match="see itself"):
        kern.decode_attention(qkv, cos_t[pos], sin_t[pos], pos, data[0], data[1], H, slots=2,
                              tree=marks & ~torch.eye(t, dtype=torch.bool))  # fmt: skip
    with pytest.raises(ValueError, match="bool"):
        kern.decode_attention(qkv, cos_t[pos], sin_t[pos], pos, data[0], data[1], H, slots=2, tree=marks[:, :4, :4])
    apart = pos.clone()
    apart[-1] += 1  # a slot's nodes not at consecutive positions
    with pytest.raises(ValueError, match="refused"):
        kern.decode_attention(qkv, cos_t[pos], sin_t[pos], apart, data[0], data[1], H, slots=2, tree=marks)


def test_a_row_with_nan_fails_alone_and_leaves_its_slot_finite() -> None:
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, H + 2 * KV, D, generator=gen)
    qkv[0] = math.nan
    cache = torch.zeros(2, 2, KV, MAX_LEN, D)
    cos_t, sin_t = _tables()
    pos = torch.tensor([5, 5])
    out = kern.decode_attention(qkv, cos_t[pos], sin_t[pos], pos, cache[0], cache[1], H)
    assert out[0].isnan().all() and out[1].isfinite().all()
    assert cache.isfinite().all() and cache[:, 0, :, 5].eq(0).all()  # NaN is stored as 0


def test_decode_attention_refuses_what_does_not_fit() -> None:
    kern = compiled_kernels()
    qkv = torch.zeros(1, H + 2 * KV, D)
    cos_t, sin_t = _tables()
    cache = torch.zeros(2, 1, KV, MAX_LEN, D)
    with pytest.raises(ValueError, match="refused"):
        kern.decode_attention(qkv, cos_t[:1], sin_t[:1], torch.tensor([MAX_LEN]), cache[0], cache[1], H)
    with pytest.raises(ValueError, match="positions must be int64"):
        kern.decode_attention(qkv, cos_t[:1], sin_t[:1], torch.tensor([1], dtype=torch.int32), cache[0], cache[1], H)
    with pytest.raises(ValueError, match="for 8 heads"):
        kern.decode_attention(qkv, cos_t[:1], sin_t[:1], torch.tensor([1]), cache[0], cache[1], 8)
    three = torch.zeros(3, H + 2 * KV, D)  # a chain's rows are whole tokens of the slots
    with pytest.raises(ValueError, match="not whole tokens of 2 slots"):
        kern.decode_attention(three, cos_t[:3], sin_t[:3], torch.tensor([1, 1, 2]), cache[0].expand(2, -1, -1, -1),
                              cache[1].expand(2, -1, -1, -1), H, slots=2)  # fmt: skip
    empty = kern.decode_attention(qkv[:0], cos_t[:0], sin_t[:0], torch.tensor([], dtype=torch.int64), cache[0, :0],
                                  cache[1, :0], H)  # fmt: skip
    assert empty.shape == (0, H * D)  # no rows: nothing to do, not an error


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_float64(with_residual: bool) -> None:
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(5)
    x, y, w = torch.randn(3, 4, 576, generator=gen), torch.randn(3, 4, 576, generator=gen), torch.randn(576)
    s = (x.double() + y.double()) if with_residual else x.double()
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    out = kern.add_rmsnorm(x, y if with_residual else None, w, 1e-5)
    assert torch.allclose(x.double(), s, rtol=0, atol=1e-6)  # the residual stream, updated in place
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-6


def test_silu_mul_matches_float64_at_the_edges_of_exp() -> None:
    kern = compiled_kernels()
    gate = torch.cat((torch.linspace(-100.0, 100.0, 1001), torch.tensor([0.0, -0.0, 1e-30, -88.5, 88.5])))
    up = torch.randn(gate.shape[0], generator=torch.Generator().manual_seed(6))
    out = kern.silu_mul(torch.cat((gate, up))[None])[0]
    ref = F.silu(gate.double()) * up.double()
    assert float(((out.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max()) < 1e-6
    assert kern.silu_mul(torch.tensor([[math.nan, 1.0]]))[0].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_mul_gives_a_value_the_same_bits_16_at_a_time_and_alone(dtype: torch.dtype) -> None:
    """The vector body (16 lanes) and the scalar tail compute each value alike: 320 gates in one row (all in the
    body) and in 320 rows of one (all in the tail), the edges of exp among them."""
    kern = compiled_kernels()
    gate = torch.cat((torch.linspace(-100.0, 100.0, 314), torch.tensor([0.0, -0.0, 1e-30, -88.5, 88.5, 87.1])))
    up = torch.randn(gate.shape[0], generator=torch.Generator().manual_seed(7))
    gate, up = gate.to(dtype), up.to(dtype)
    body = kern.silu_mul(torch.cat((gate, up))[None])[0]
    alone = kern.silu_mul(torch.stack((gate, up), dim=1))[:, 0]
    assert torch.equal(body, alone)


def test_a_tiny_llama_decodes_the_same_fused_and_eager(tiny_llama_factory: Callable[..., Path]) -> None:
    compiled_kernels()
    folder = tiny_llama_factory()
    fused = load_ours(folder)
    with kernels_mode("eager"):
        eager = load_ours(folder)
    assert fused.native is not None and eager.native is None
    gen = torch.Generator().manual_seed(8)
    prompts = torch.randint(3, fused.cfg.vocab_size, (3, 6), generator=gen)
    lengths = torch.tensor([6, 2, 4])  # right-padded rows: each decodes from its own length
    caches, tokens, states = [], [], []
    for model in (fused, eager):
        cache = KVCache(model.cfg, slots=4, max_len=32, dtype=torch.float32, device=torch.device("cpu"))
        positions = torch.arange(6).expand(3, 6)
        hidden = model(prompts, positions, cache, 1)
        nxt = model.logits(model.gather_last(hidden, lengths)).argmax(-1)
        seq, step_states = [nxt], [hidden]
        pos = lengths.clone()
        for _ in range(8):
            h = model(nxt[:, None], pos[:, None], cache, 1)  # one token a row: the fused decode attention
            nxt = model.logits(h[:, -1]).argmax(-1)
            seq.append(nxt)
            step_states.append(h)
            pos += 1
        caches.append(cache.data)
        tokens.append(torch.stack(seq))
        states.append(step_states)
    assert torch.equal(tokens[0], tokens[1])
    for a, b in zip(*states, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert torch.allclose(caches[0], caches[1], rtol=1e-4, atol=1e-5)


# --- bfloat16 ---------------------------------------------------------------------------------------------------

BF16_ULP = 2.0**-8  # a bf16 rounding is at most half of this, relative


def _bf16_tables() -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    return rope_table(inv_freq, MAX_LEN, dtype=torch.bfloat16, device=torch.device("cpu"))


def test_bf16_decode_attention_writes_eagers_bf16_kv_and_attends_in_float32() -> None:
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(13)
    pos = torch.tensor([7, 30, 0, 39])
    b = len(pos)
    qkv = (torch.randn(b, H + 2 * KV, D, generator=gen) * 3).bfloat16()
    qkv[1, H] = qkv[1, H] * 1e6  # a huge K head: bounded in the cache
    data = torch.randn(2, b + 2, KV, MAX_LEN, D, generator=gen).bfloat16()
    for r, p in enumerate(pos.tolist()):
        data[:, 1 + r, :, p + 1 :] = math.nan  # past each row's position: never read
    want = data.clone()
    cos_t, sin_t = _bf16_tables()
    cos, sin = cos_t[pos], sin_t[pos]  # [B, D] bf16
    qk = apply_rope(qkv[:, None, : H + KV], cos[:, None, None], sin[:, None, None])[:, 0]  # eager, in bf16
    for r, p in enumerate(pos.tolist()):
        want[0, 1 + r, :, p] = finite_kv(qk[r, H:])
        want[1, 1 + r, :, p] = finite_kv(qkv[r, H + KV :])
    out = kern.decode_attention(qkv, cos, sin, pos, data[0].narrow(0, 1, b), data[1].narrow(0, 1, b), H)
    assert out.dtype == torch.bfloat16
    assert torch.equal(data.float().nan_to_num(7.0), want.float().nan_to_num(7.0))  # bit-identical writes
    for r, p in enumerate(pos.tolist()):
        ref = _attend64(qk[r, :H], want[0, 1 + r, :, : p + 1], want[1, 1 + r, :, : p + 1])
        err = (out[r].double() - ref).abs() / ref.abs().clamp_min(1e-3)
        assert float(err.max()) <= BF16_ULP, r  # one rounding of a float32 result


def test_bf16_a_row_with_nan_fails_alone_and_leaves_its_slot_finite() -> None:
    kern = compiled_kernels()
    qkv = torch.randn(2, H + 2 * KV, D, generator=torch.Generator().manual_seed(14)).bfloat16()
    qkv[0] = math.nan
    cache = torch.zeros(2, 2, KV, MAX_LEN, D, dtype=torch.bfloat16)
    cos_t, sin_t = _bf16_tables()
    pos = torch.tensor([5, 5])
    out = kern.decode_attention(qkv, cos_t[pos], sin_t[pos], pos, cache[0], cache[1], H)
    assert out[0].isnan().all() and out[1].isfinite().all()
    assert cache.isfinite().all() and cache[:, 0, :, 5].eq(0).all()


@pytest.mark.parametrize("with_residual", [True, False])
def test_bf16_add_rmsnorm_keeps_a_float32_stream_and_rounds_once(with_residual: bool) -> None:
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(3, 4, 576, generator=gen)
    y, w = torch.randn(3, 4, 576, generator=gen).bfloat16(), torch.randn(576, generator=gen).bfloat16()
    s = (x + y.float()) if with_residual else x.clone()  # float32 + widened bf16: exact as eager's promotion
    ref = s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    out = kern.add_rmsnorm(x, y if with_residual else None, w, 1e-5)
    assert out.dtype == torch.bfloat16 and torch.equal(x, s)  # the float32 stream, updated in place
    assert float(((out.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max()) <= BF16_ULP
    eager = F.rms_norm(s, w.shape, w.float(), 1e-5).to(torch.bfloat16)  # the eager bf16 model's norm
    assert float((out.float() - eager.float()).abs().max()) <= BF16_ULP * float(eager.float().abs().max())


def test_bf16_silu_mul_matches_eager_within_one_rounding() -> None:
    kern = compiled_kernels()
    gen = torch.Generator().manual_seed(16)
    gu = (torch.randn(5, 2 * 1536, generator=gen) * 4).bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    out = kern.silu_mul(gu)
    eager = F.silu(gate).mul_(up)  # what a bf16 model's eager FeedForward computes
    ref = F.silu(gate.double()).to(torch.bfloat16).double() * up.double()  # silu held in bf16, then the product
    assert out.dtype == torch.bfloat16
    assert float(((out.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max()) <= BF16_ULP
    assert float((out.float() - eager.float()).abs().max()) <= 2 * BF16_ULP * float(eager.float().abs().max())


def test_the_step_ops_take_one_dtype_and_a_float32_stream() -> None:
    kern = compiled_kernels()
    w = torch.zeros(576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype"):
        kern.add_rmsnorm(torch.zeros(1, 576), torch.zeros(1, 576), w, 1e-5)
    with pytest.raises(ValueError, match="residual stream x must be float32"):
        kern.add_rmsnorm(torch.zeros(1, 576, dtype=torch.bfloat16), None, w, 1e-5)
    with pytest.raises(ValueError, match="float32 / bfloat16"):
        kern.silu_mul(torch.zeros(1, 8, dtype=torch.float16))


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 49152])
def test_row_top_is_torchs_max_ties_nan_and_inf_included(n: int) -> None:
    """Sampling's argmax and finiteness check in one pass (``lp_row_top``): each row's largest value and the first
    column holding it, as ``max(dim=-1)`` gives them, through the 16-lane body and the tail, in parallel or not."""
    kern = compiled_kernels()
    x = torch.randn(9, n, generator=torch.Generator().manual_seed(n))
    x[1] = 0.0  # every column tied: the first
    x[2, n // 2] = x[2, n - 1] = 1e30  # two tied maxima: the first
    x[3, n - 1] = x[3, n // 3] = math.nan  # NaN wins, at its first column
    x[4, n // 2], x[5] = math.inf, -math.inf
    x[6, n - 1] = 50.0  # the largest in the last column (the tail, where there is one)
    x[7, 0] = -1e30
    values, indices = kern.row_top(x)
    ref = x.max(dim=-1)
    torch.testing.assert_close(values, ref.values, rtol=0, atol=0, equal_nan=True)
    assert indices.tolist() == ref.indices.tolist()
    with pytest.raises(ValueError, match="contiguous float32"):
        kern.row_top(x.bfloat16())
    with pytest.raises(ValueError, match="contiguous float32"):
        kern.row_top(torch.zeros(9, 2 * n)[:, ::2])


def test_a_tiny_bf16_llama_decodes_near_the_eager_path(tiny_llama_factory: Callable[..., Path]) -> None:
    compiled_kernels()
    folder = tiny_llama_factory()
    fused = load_ours(folder, dtype=torch.bfloat16)
    with kernels_mode("eager"):
        eager = load_ours(folder, dtype=torch.bfloat16)
    assert fused.native is not None and eager.native is None
    prompts = torch.randint(3, fused.cfg.vocab_size, (3, 6), generator=torch.Generator().manual_seed(18))
    logits = []
    for model in (fused, eager):
        cache = KVCache(model.cfg, slots=4, max_len=32, dtype=torch.bfloat16, device=torch.device("cpu"))
        model(prompts, torch.arange(6).expand(3, 6), cache, 1)
        tokens, steps = prompts[:, -1], []  # the same tokens fed to both: compare the logits step by step
        for t in range(6, 14):
            h = model(tokens[:, None], torch.full((3, 1), t), cache, 1)  # the fused decode attention in bf16
            steps.append(model.logits(h[:, -1]))
            tokens = (tokens * 7 + t) % model.cfg.vocab_size
        logits.append(torch.stack(steps))
    scale = float(logits[1].abs().max())
    assert float((logits[0] - logits[1]).abs().max()) < 0.05 * scale  # bf16 rounding, not a wrong op
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.9
