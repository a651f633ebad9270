"""service.model against transformers' LlamaForCausalLM on tiny random checkpoints (fp32, CPU).

Each variant is written by transformers itself (tests/support/tiny_models.py) and read back by both implementations,
so a tensor routed to the wrong fused slice, a RoPE variant computed differently or a mask that lets a row see the
wrong keys all show up as logit differences.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.tiny_models import greedy_generate, load_hf_llama, load_ours

from service.model import KVCache, Llama

pytestmark = pytest.mark.numerics

CPU = torch.device("cpu")
ATOL = 1e-4

VARIANTS: dict[str, dict[str, Any]] = {
    "gqa": {},
    "mha_bias_tied": {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    "mqa_mlp_bias": {"num_key_value_heads": 1, "mlp_bias": True},
    "llama3_rope": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    "linear_rope": {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}},
    "legacy_keys_llama3": {
        "legacy_rope_keys": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 2.0,
            "original_max_position_embeddings": 16,
        },
    },
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tiny_llama_factory: Callable[..., Path]) -> tuple[Llama, Any]:
    folder = tiny_llama_factory(seed=len(request.param), **VARIANTS[request.param])
    return load_ours(folder), load_hf_llama(folder)


def _prompt(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))  # [n]


@torch.no_grad()
def _hf_logits(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None, :]).logits[0]  # [n, vocab]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_prefill_matches_transformers(pair: tuple[Llama, Any]) -> None:
    ours, hf = pair
    ids = _prompt(40, seed=1)
    cache = KVCache(ours.cfg, 2, 64, dtype=torch.float32, device=CPU)
    hidden = ours(ids[None, :], torch.arange(40)[None, :], cache, 1)  # slot 1 of 2
    assert _max_diff(ours.logits(hidden)[0], _hf_logits(hf, ids)) < ATOL


def test_prefill_then_decode_matches_transformers(pair: tuple[Llama, Any]) -> None:
    ours, hf = pair
    ids = _prompt(30, seed=2)
    ref = _hf_logits(hf, ids)  # [30, vocab]
    cache = KVCache(ours.cfg, 1, 64, dtype=torch.float32, device=CPU)
    got = [ours.logits(ours(ids[None, :7], torch.arange(7)[None, :], cache, 0))[0]]
    for t in range(7, 30):
        got.append(ours.logits(ours(ids[None, t : t + 1], torch.tensor([[t]]), cache, 0))[0])
    assert _max_diff(torch.cat(got), ref) < ATOL


def test_right_padded_batch_rows_match_their_own_reference(pair: tuple[Llama, Any]) -> None:
    ours, hf = pair
    lengths = [7, 3, 12, 1]
    prompts = [_prompt(n + 1, seed=10 + i) for i, n in enumerate(lengths)]  # one extra token to decode next
    width = max(lengths)
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)  # pad id 0 on the right
    for row, (ids, n) in enumerate(zip(prompts, lengths, strict=True)):
        tokens[row, :n] = ids[:n]
    positions = torch.arange(width).expand(len(lengths), width)
    cache = KVCache(ours.cfg, 6, 32, dtype=torch.float32, device=CPU)
    logits = ours.logits(ours(tokens, positions, cache, 2))  # slots 2..5
    next_tokens = torch.stack([ids[n] for ids, n in zip(prompts, lengths, strict=True)])[:, None]  # [B, 1]
    next_pos = torch.tensor(lengths)[:, None]  # each row continues at its own length, over stale padding K/V
    step = ours.logits(ours(next_tokens, next_pos, cache, 2))[:, 0]  # [B, vocab]
    for row, (ids, n) in enumerate(zip(prompts, lengths, strict=True)):
        ref = _hf_logits(hf, ids)  # [n + 1, vocab]
        assert _max_diff(logits[row, :n], ref[:n]) < ATOL, f"prefill row {row}"
        assert _max_diff(step[row], ref[n]) < ATOL, f"decode row {row}"


def test_greedy_continuation_is_token_identical_to_generate(pair: tuple[Llama, Any]) -> None:
    ours, hf = pair
    for seed in (3,):
        ids = _prompt(5 + seed, seed=seed)
        ref = hf.generate(ids[None, :], max_new_tokens=64, do_sample=False, eos_token_id=2, pad_token_id=0)
        expected = ref[0, len(ids) :].tolist()
        assert greedy_generate(ours, ids.tolist(), 64, eos_token_ids=(2,)) == expected


def test_kv_cache_move_then_decode_equals_never_moving(tiny_llama_dir: Path) -> None:
    ours = load_ours(tiny_llama_dir)
    lengths = [6, 4, 9]
    tokens = torch.stack([_prompt(9, seed=20 + r) for r in range(3)])  # [3, 9], rows use their first n tokens
    positions = torch.arange(9).expand(3, 9)
    steps = torch.stack([_prompt(5, seed=30 + r) for r in range(3)])  # [3, 5] tokens to decode next

    def run(move: bool) -> torch.Tensor:
        cache = KVCache(ours.cfg, 3, 32, dtype=torch.float32, device=CPU)
        ours(tokens, positions, cache, 0)
        keep = [0, 1, 2]
        if move:  # row 1 retires: the last row's cache moves into its hole and the batch shrinks to slots 0..1
            cache.move(2, 1, lengths[2])
            cache.k[0][2].fill_(float("nan"))  # the vacated slot must not be read any more
            keep = [0, 2]
        out = []
        for s in range(5):
            tok = steps[keep, s : s + 1]
            pos = torch.tensor([[lengths[r] + s] for r in keep])
            out.append(ours.logits(ours(tok, pos, cache, 0))[:, 0])
        result = torch.stack(out, dim=1)  # [B, 5, vocab]
        return result if move else result[[0, 2]]

    torch.testing.assert_close(run(move=True), run(move=False), rtol=1e-5, atol=1e-5)


def test_kv_cache_shape_and_bytes(tiny_llama_dir: Path) -> None:
    ours = load_ours(tiny_llama_dir)
    cfg = ours.cfg
    cache = KVCache(cfg, 3, 20, dtype=torch.bfloat16, device=CPU)
    assert cache.k[1].shape == (3, cfg.num_kv_heads, 20, cfg.head_dim)
    assert cache.nbytes == cfg.num_layers * 2 * 3 * cfg.num_kv_heads * 20 * cfg.head_dim * 2
    with pytest.raises(ValueError):
        cache.move(0, 3, 5)
    with pytest.raises(ValueError):
        cache.move(0, 1, 21)


def test_rollback_by_position(tiny_llama_dir: Path) -> None:
    """Verify-style [B, k+1] step, then roll back and redo: only positions <= the query are attended."""
    ours, hf = load_ours(tiny_llama_dir), load_hf_llama(tiny_llama_dir)
    ids = _prompt(12, seed=6)
    cache = KVCache(ours.cfg, 1, 32, dtype=torch.float32, device=CPU)
    ours(ids[None, :8], torch.arange(8)[None, :], cache, 0)
    draft = _prompt(4, seed=7)  # wrong guesses written at positions 8..11
    ours(draft[None, :], torch.arange(8, 12)[None, :], cache, 0)
    # Roll back to length 8 and verify the true continuation in one [1, 4] step.
    got = ours.logits(ours(ids[None, 8:12], torch.arange(8, 12)[None, :], cache, 0))[0]
    assert _max_diff(got, _hf_logits(hf, ids)[8:12]) < ATOL


def test_bf16_close_to_fp32(tiny_llama_dir: Path) -> None:
    fp32, bf16 = load_ours(tiny_llama_dir), load_ours(tiny_llama_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    ids = _prompt(16, seed=8)
    pos = torch.arange(16)[None, :]
    ref = fp32.logits(fp32(ids[None, :], pos, KVCache(fp32.cfg, 1, 16, dtype=torch.float32, device=CPU), 0))
    got = bf16.logits(bf16(ids[None, :], pos, KVCache(bf16.cfg, 1, 16, dtype=torch.bfloat16, device=CPU), 0))
    assert got.dtype == torch.float32
    # bf16 keeps ~3 significant digits; a wrong layout or dtype mix-up would be off by O(logit).
    assert _max_diff(got, ref) < 0.05 * float(ref.abs().max())
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_the_cpu_reference(tiny_llama_dir: Path, dtype: torch.dtype) -> None:
    from service.model.load_folder import load_model

    cuda = torch.device("cuda")
    ours, cfg, _ = load_model(tiny_llama_dir, dtype=dtype, device=cuda)
    ids = _prompt(20, seed=9)
    ref = _hf_logits(load_hf_llama(tiny_llama_dir), ids)  # [20, vocab] on the CPU, fp32
    cache = KVCache(cfg, 3, 32, dtype=dtype, device=cuda)
    tokens = ids.to(cuda)[None, :]
    got = [ours.logits(ours(tokens[:, :12], torch.arange(12, device=cuda)[None, :], cache, 2, kv_len=12))[0]]
    for t in range(12, 20):
        pos = torch.tensor([[t]], device=cuda)
        got.append(ours.logits(ours(tokens[:, t : t + 1], pos, cache, 2, kv_len=t + 1))[0])
    out = torch.cat(got).cpu()
    if dtype == torch.float32:
        assert _max_diff(out, ref) < 1e-3  # TF32 may be on for the CUDA matmuls
    else:
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_kv_cache_keep_path_moves_only_the_accepted_nodes(tiny_llama_dir: Path) -> None:
    cfg = load_ours(tiny_llama_dir).cfg
    cache = KVCache(cfg, 2, 16, dtype=torch.float32, device=CPU)
    for pos in range(16):
        cache.data[:, :, 1, :, pos] = float(pos)  # slot 1: every position holds its own number
    before = cache.data.clone()
    cache.keep_path(1, 4, [1, 2])  # already in place: nothing moves
    assert torch.equal(cache.data, before)
    cache.keep_path(1, 4, [2, 5])  # tree nodes 2 and 5 (positions 6, 9) become positions 5, 6
    got = cache.data[0, 0, 1, 0, :, 0].tolist()
    assert got[:5] == [0, 1, 2, 3, 4] and got[5:7] == [6.0, 9.0] and got[7:] == list(range(7, 16))
    assert torch.equal(cache.data[:, :, 0], before[:, :, 0])  # other slots untouched
    with pytest.raises(ValueError):
        cache.keep_path(1, 14, [3])
    cache.clear(2, 6)
    assert not cache.data[:, :, :2, :, :6].any() and cache.data[0, 0, 1, 0, 6, 0] == 9.0  # past length: kept
