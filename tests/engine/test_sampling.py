"""Sampling: processed distributions equal transformers' logits processors; seeds and batch independence."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from service.engine.sampling import (
    _CDF_BLOCK,
    _TOP_P_CANDIDATES,
    GREEDY_TEMPERATURE,
    RandomStream,
    Sampler,
    SamplingParams,
    _inverse_cdf,
    greedy,
    make_generator,
)
from service.errors import InvalidRequest

V = 1000


def _logits(b: int, seed: int = 0, v: int = V) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((b, v), generator=gen) * 3.0


def _hf(
    logits: torch.Tensor, p: SamplingParams, history: torch.Tensor | None = None
) -> torch.Tensor:  # one row [1, V] -> [1, V], in transformers' order
    x = logits.clone()
    ids = history if history is not None else torch.zeros((1, 0), dtype=torch.long)
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty))(ids, x)
    if p.temperature != 1.0:
        x = TemperatureLogitsWarper(float(p.temperature))(ids, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(float(p.top_p))(ids, x)
    return x


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_k=50),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.5, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=0.01),  # keeps only the most likely token
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95),
    SamplingParams(temperature=1.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8, repetition_penalty=0.7),
    SamplingParams(temperature=1.0, top_k=V + 10),  # k beyond the vocabulary keeps everything
    SamplingParams(temperature=1.1, repetition_penalty=1.2),
]


def test_processed_logits_match_transformers_per_case() -> None:
    sampler = Sampler()
    logits = _logits(len(CASES), seed=1)
    gen = torch.Generator().manual_seed(2)
    # Half the rows see a short history with many repeats, the rest a spread-out one; one row sees none.
    history = [torch.randint(0, 40 if i % 2 else V, (60,), generator=gen) for i in range(len(CASES))]
    history[8] = torch.zeros((0,), dtype=torch.long)
    ours = sampler.process_logits(logits, CASES, history)
    for i, p in enumerate(CASES):
        ref = _hf(logits[i : i + 1], p, history[i][None, :])
        if p.penalized and history[i].numel():
            assert not torch.equal(ref, logits[i : i + 1] / p.temperature)  # the penalty really changed something
        # Same tokens removed, same values elsewhere.
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref[0])), f"case {i} {p}: different support"
        torch.testing.assert_close(ours[i], ref[0], rtol=1e-6, atol=1e-6, msg=f"case {i} {p}")
        torch.testing.assert_close(
            sampler.processed_probs(logits[i : i + 1], [p], [history[i]])[0], torch.softmax(ref[0], -1)
        )


@pytest.mark.parametrize("scale", [4.0, 0.05])  # peaked: nucleus among the candidates; flat: full-sort fallback
def test_top_p_on_a_large_vocabulary_matches_transformers(scale: float) -> None:
    v = 8 * _TOP_P_CANDIDATES
    logits = _logits(6, seed=7, v=v) * scale
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.1, 0.5, 0.8, 0.9, 0.95, 0.999)]
    ours = Sampler().process_logits(logits, params)
    kept = []
    for i, p in enumerate(params):
        ref = _hf(logits[i : i + 1], p)[0]
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), f"top_p={p.top_p}: different nucleus"
        kept.append(int(torch.isfinite(ref).sum()))
    if scale > 1:
        assert max(kept) < _TOP_P_CANDIDATES  # the fast path decided every row
    else:
        assert max(kept) > _TOP_P_CANDIDATES  # some rows needed the fallback


def test_inverse_cdf_draws_follow_the_distribution_across_blocks() -> None:
    gen = torch.Generator().manual_seed(8)
    v = 3 * _CDF_BLOCK + 17  # several blocks plus a padded one
    probs = torch.softmax(torch.randn(v, generator=gen) * 2, dim=-1)
    n = 20000
    u = torch.rand(n, dtype=torch.float64, generator=gen)
    ids = _inverse_cdf(probs[None, :].expand(n, v), u)
    freq = torch.bincount(ids, minlength=v).double() / n
    block_of = torch.arange(v) // _CDF_BLOCK
    expected_blocks = torch.zeros(4, dtype=torch.float64).index_add_(0, block_of, probs.double())
    got_blocks = torch.zeros(4, dtype=torch.float64).index_add_(0, block_of, freq)
    torch.testing.assert_close(got_blocks, expected_blocks, atol=0.015, rtol=0)
    top = probs.topk(5).indices
    torch.testing.assert_close(freq[top], probs[top].double(), atol=0.01, rtol=0)
    # The same u against the exact cumulative distribution picks the same ids.
    exact = torch.searchsorted(probs.double().cumsum(0), (u * probs.double().sum())[:, None], right=True)
    assert (exact.squeeze(-1) == ids).double().mean() > 0.999


def test_top_k_keeps_ties_like_transformers() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5, 2.0]])
    p = SamplingParams(temperature=1.0, top_k=2)
    ours = Sampler().process_logits(logits, [p])
    ref = _hf(logits, p)
    assert torch.equal(ours, ref)
    assert int(torch.isfinite(ours).sum()) == 4  # 3.0 and all three 2.0s


def test_greedy_rows_only_get_the_penalty() -> None:
    logits = _logits(2, seed=3)
    hist = [[1, 2, 3], [4, 5]]
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams()]
    ours = Sampler().process_logits(logits, params, hist)
    ref = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[1, 2, 3]]), logits[:1].clone())
    assert torch.equal(ours[0], ref[0])
    assert torch.equal(ours[1], logits[1])
    res = Sampler().sample(logits, params, [None, None], hist)
    assert res.tokens.tolist() == [int(ref[0].argmax()), int(logits[1].argmax())]


def test_all_greedy_fast_path_is_argmax_with_logprobs() -> None:
    logits = _logits(4, seed=4)
    params = [SamplingParams(logprobs=True)] * 4
    res = Sampler().sample(logits, params)
    assert torch.equal(res.tokens, logits.argmax(-1))
    assert torch.equal(greedy(logits), logits.argmax(-1))
    assert res.logprobs is not None
    torch.testing.assert_close(res.logprobs, torch.log_softmax(logits, -1).max(-1).values)
    assert Sampler().sample(logits, [SamplingParams()] * 4).logprobs is None


def test_logprobs_come_from_the_processed_distribution() -> None:
    logits = _logits(3, seed=5)
    params = [
        SamplingParams(temperature=0.7, top_k=10, logprobs=True),
        SamplingParams(logprobs=True),
        SamplingParams(temperature=1.0, top_p=0.5, logprobs=True),
    ]
    gens = [make_generator(i) for i in range(3)]
    res = Sampler().sample(logits, params, gens)
    assert res.logprobs is not None
    for i, p in enumerate(params):
        ref = torch.log_softmax(_hf(logits[i : i + 1], p) if not p.greedy else logits[i : i + 1], -1)[0]
        tok = int(res.tokens[i])
        assert math.isfinite(float(res.logprobs[i]))  # never a filtered-out token
        torch.testing.assert_close(res.logprobs[i], ref[tok])


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    sampler = Sampler()
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    steps = [_logits(1, seed=100 + s) for s in range(20)]

    def run(batch_extra: int, other_seed: int) -> list[int]:
        gen = make_generator(target.seed)
        others = [make_generator(other_seed + j) for j in range(batch_extra)]
        out = []
        for s, row in enumerate(steps):
            noise = _logits(batch_extra, seed=999 + s) if batch_extra else torch.empty((0, V))
            batch = torch.cat([noise[: batch_extra // 2], row, noise[batch_extra // 2 :]])
            params = [SamplingParams(temperature=1.2, top_k=7)] * batch_extra
            params.insert(batch_extra // 2, target)
            gens: list[RandomStream | None] = list(others)
            gens.insert(batch_extra // 2, gen)
            out.append(int(sampler.sample(batch, params, gens).tokens[batch_extra // 2]))
        return out

    alone = run(0, 0)
    assert run(3, 7) == alone
    assert run(6, 50) == alone
    # A different seed gives a different stream (the distribution is wide enough for 20 draws to differ).
    other = make_generator(4321)
    diff = [int(sampler.sample(row, [target], [other]).tokens[0]) for row in steps]
    assert diff != alone


def test_sampling_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    logits = torch.log(probs)[None, :].repeat(4000, 1)
    gens = [make_generator(i) for i in range(4000)]
    res = Sampler().sample(logits, [SamplingParams(temperature=1.0)] * 4000, gens)
    counts = torch.bincount(res.tokens, minlength=5).double() / 4000
    assert counts[4] == 0
    torch.testing.assert_close(counts, probs.double(), atol=0.03, rtol=0)


def test_processed_probs_greedy_rows_are_one_hot() -> None:
    logits = _logits(2, seed=6)
    probs = Sampler().processed_probs(logits, [SamplingParams(), SamplingParams(temperature=1.0)])
    assert float(probs[0].max()) == 1.0 and int(probs[0].argmax()) == int(logits[0].argmax())
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))


def test_draw_uses_each_rows_generator() -> None:
    weights = torch.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, 0.0, 0.0, 2.0]])
    sampler = Sampler()
    first = sampler.draw(weights, [make_generator(1), make_generator(2)])
    again = sampler.draw(weights.flip(0), [make_generator(2), make_generator(1)])
    assert first.tolist() == again.flip(0).tolist()
    many = sampler.draw(weights[:1].repeat(2000, 1), [make_generator(i) for i in range(2000)])
    assert set(many.tolist()) == {1, 2}
    assert abs(float((many == 2).double().mean()) - 0.75) < 0.04


def test_repetition_penalty_requires_history() -> None:
    with pytest.raises(ValueError, match="history"):
        Sampler().sample(_logits(1), [SamplingParams(repetition_penalty=1.2)])


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-45}, r"repetition_penalty must be in \[0.01, 100"),
        ({"repetition_penalty": 1e-3}, "repetition_penalty"),
        ({"repetition_penalty": 1e3}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"seed": -5}, "seed"),
    ],
)
def test_invalid_params_cannot_be_built(fields: dict[str, float], match: str) -> None:
    """Valid by construction: the constructor runs the one copy of the rules and names the field."""
    with pytest.raises(InvalidRequest, match=match) as err:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert err.value.field == f"sampling.{next(iter(fields))}"


def test_defaults_are_valid_and_greedy() -> None:
    p = SamplingParams()
    p.validate()
    assert p.greedy and not p.penalized


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-30, GREEDY_TEMPERATURE / 2])
def test_tiny_temperatures_are_greedy_with_finite_logprobs(temperature: float) -> None:
    # float32 cannot hold logits / 1e-38: the old sampler drew from a NaN distribution (garbage tokens).
    t32 = float(torch.tensor(temperature, dtype=torch.float32))  # what the proto's float field delivers
    logits = _logits(4, seed=11) * 10
    params = [SamplingParams(temperature=t, seed=3, logprobs=True) for t in (temperature, t32, temperature, t32)]
    res = Sampler().sample(logits, params, [make_generator(3) for _ in params])
    assert res.tokens.tolist() == greedy(logits).tolist()
    assert res.logprobs is not None and bool(torch.isfinite(res.logprobs).all())
    mixed = [SamplingParams(temperature=1.0, repetition_penalty=1.3, logprobs=True), params[0]]  # not the fast path
    res = Sampler().sample(logits[:2], mixed, [make_generator(1), make_generator(2)], [[1, 2, 3], [4, 5]])
    assert int(res.tokens[1]) == int(logits[1].argmax())
    assert res.logprobs is not None and bool(torch.isfinite(res.logprobs).all())


def test_small_temperature_above_the_epsilon_still_samples_finitely() -> None:
    logits = _logits(2, seed=12) * 30
    p = SamplingParams(temperature=GREEDY_TEMPERATURE * 2, logprobs=True)
    assert not p.greedy
    res = Sampler().sample(logits, [p, p], [make_generator(1), make_generator(2)])
    assert res.tokens.tolist() == greedy(logits).tolist()  # that cold, only the argmax has mass
    assert res.logprobs is not None and bool(torch.isfinite(res.logprobs).all())


@pytest.mark.parametrize("penalty", [0.01, 100.0])
def test_extreme_valid_penalties_keep_logits_finite(penalty: float) -> None:
    logits = _logits(2, seed=13) * 10
    params = [SamplingParams(repetition_penalty=penalty, logprobs=True), SamplingParams(temperature=0.7,
              repetition_penalty=penalty, logprobs=True)]  # fmt: skip
    res = Sampler().sample(logits, params, [None, make_generator(5)], [list(range(0, 1000, 3))] * 2)
    assert res.logprobs is not None and bool(torch.isfinite(res.logprobs).all())


def _stream(seed: int, n: int = 8) -> list[float]:
    return make_generator(seed).uniforms(n)


def test_seeds_use_all_64_bits() -> None:
    # torch's CPU generator keeps the low 32 bits: s, s + 2**32 and s + 2**63 gave the same tokens.
    s = 12345
    streams = [_stream(x) for x in (s, s + 2**32, s + 2**63, 2**64 - 1, 2**63 - 1)]
    assert len({tuple(x) for x in streams}) == len(streams)
    assert _stream(s) == _stream(s)  # and a seed is still reproducible
    logits = _logits(1, seed=14)
    p = SamplingParams(temperature=1.0, seed=s)
    draws = [
        [int(Sampler().sample(logits, [p], [gen]).tokens[0]) for _ in range(30)]
        for gen in (make_generator(s), make_generator(s + 2**63))
    ]
    assert draws[0] != draws[1]
