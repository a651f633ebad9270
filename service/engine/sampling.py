"""Batched token sampling: each row of a decode batch carries its own sampling parameters and random stream.

The processing order and the semantics of every step match transformers' ``generate`` exactly
(``RepetitionPenaltyLogitsProcessor`` → ``TemperatureLogitsWarper`` → ``TopKLogitsWarper`` →
``TopPLogitsWarper``), so a request sampled here sees the same distribution it would see there.

Randomness is per request: the engine gives every sampled row its own ``RandomStream``
(``service.engine.random_streams``) and each row draws exactly one uniform number per step from it. The token is
then found by inverse-CDF lookup in that row's distribution, so a row's output depends only on its own logits,
parameters and generator — never on which other requests share the batch.

Numerics: logits are processed in float32 and every softmax / log-probability is the max-shifted kind
(``torch.softmax``, ``logsumexp``). Temperatures below ``GREEDY_TEMPERATURE`` are greedy (dividing by them would
overflow float32 into inf and NaN), and the repetition penalty is refused outside
[``MIN_REPETITION_PENALTY``, ``MAX_REPETITION_PENALTY``] for the same reason, so processed logits stay finite.

The hot path (every decode step of an all-greedy batch without penalties) is a single ``argmax``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from service.engine.random_streams import MAX_SEED, Generator, RandomStream, make_generator, uniforms
from service.errors import InvalidRequest

__all__ = [
    "GREEDY_TEMPERATURE",
    "MAX_REPETITION_PENALTY",
    "MIN_REPETITION_PENALTY",
    "RandomStream",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "greedy",
    "make_generator",
]

# Below this a temperature means greedy decoding: logits / 1e-5 stay far inside float32 (|logit| * 1e5 < 3e38),
# while 1e-38 or 1e-45 turn every logit into +-inf and the softmax into NaN. Its distribution is one-hot anyway.
GREEDY_TEMPERATURE = 1e-5
# The repetition penalty divides or multiplies logits: within [1/100, 100] they stay finite in float32.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# Top-p looks for the nucleus among this many most likely tokens before sorting the whole vocabulary.
_TOP_P_CANDIDATES = 1024
# Inverse-CDF sampling works on blocks of this many ids.
_CDF_BLOCK = 256


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token.

    ``temperature < GREEDY_TEMPERATURE`` (0 included) means greedy decoding (then ``top_k`` / ``top_p`` have no
    effect); ``top_k == 0`` and
    ``top_p == 1`` switch those filters off; ``repetition_penalty == 1`` switches the penalty off. ``seed``
    makes a sampled request reproducible; ``logprobs`` asks for the log-probability of each chosen token.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        self.validate()  # valid by construction: every holder of a SamplingParams may rely on it

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def argmax_only(self) -> bool:
        """The next token is the logits' argmax and nothing else of them is needed."""
        return self.greedy and not self.penalized and not self.logprobs

    def validate(self) -> None:
        """Raise ``InvalidRequest`` naming the first bad field, its value and the accepted range."""
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise InvalidRequest(
                f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}", field="sampling.temperature"
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidRequest(
                f"top_k must be an integer >= 0 (0 = no top-k filter), got {self.top_k!r}", field="sampling.top_k"
            )
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1] (1 = no nucleus filter), got {p!r}", field="sampling.top_p")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
            raise InvalidRequest(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] "
                f"(1 = no penalty, > 1 discourages repeats), got {r!r}",
                field="sampling.repetition_penalty",
            )
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED
        ):
            raise InvalidRequest(
                f"seed must be an integer in [0, 2**64 - 1] or unset, got {self.seed!r}", field="sampling.seed"
            )


@dataclass(frozen=True)
class SampleResult:
    """``tokens``: [B] int64 chosen ids. ``logprobs``: [B] fp32 log-probability of each chosen id under the
    processed distribution it was drawn from (None unless some row asked for logprobs)."""

    tokens: Tensor
    logprobs: Tensor | None = None


def greedy(logits: Tensor) -> Tensor:
    """[B, V] (or [..., V]) logits → [B] int64 argmax ids. Ties resolve to the lowest id, like torch.argmax.

    ``max(dim).indices``, not ``argmax``: both are documented to return the first maximal value, and on CPU the
    reduction ``max`` runs several times faster than ``argmax`` over a bf16 vocabulary (bench/README.md)."""
    return logits.max(dim=-1).indices


History = Sequence[Tensor | Sequence[int]]


class Sampler:
    """Turns a batch of logits into one token per row, honouring each row's ``SamplingParams``."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    # ---- public API -------------------------------------------------------------------------------------------
    def sample(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[Generator | None] | None = None,
        history: History | None = None,
        argmax: Tensor | None = None,
    ) -> SampleResult:
        """Pick the next token of every row.

        logits: [B, V] fp32 (other float dtypes are upcast). ``params[i]`` and ``generators[i]`` belong to row i;
        a sampled row without a generator draws from torch's default generator (not reproducible). ``history[i]``
        holds the ids (prompt + generated) the repetition penalty looks at; it is only read for penalized rows.
        ``argmax`` [B]: ``greedy(logits)`` where the caller has it already (one pass over the logits less).
        """
        b = logits.shape[0]
        if len(params) != b:
            raise ValueError(f"got {len(params)} SamplingParams for a batch of {b} rows")
        want_logprobs = any(p.logprobs for p in params)
        if all(p.greedy and not p.penalized for p in params):
            tokens = greedy(logits) if argmax is None else argmax  # [B]
            if not want_logprobs:
                return SampleResult(tokens)
            x = logits.float()  # [B, V]
            return SampleResult(tokens, x.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(x, dim=-1))

        processed = self.process_logits(logits, params, history)  # [B, V] fp32
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            tokens = greedy(processed)  # [B]
        else:
            if generators is not None and len(generators) != b:
                raise ValueError(f"got {len(generators)} generators for a batch of {b} rows")
            u = uniforms([generators[i] if generators is not None else None for i in sampled], logits.device)
            if len(sampled) == b:
                tokens = _inverse_cdf(torch.softmax(processed, dim=-1), u)  # [B]
            else:
                rows = torch.tensor(sampled, device=logits.device)  # [S]
                drawn = _inverse_cdf(torch.softmax(processed.index_select(0, rows), dim=-1), u)  # [S]
                tokens = greedy(processed).index_copy(0, rows, drawn)  # [B]; greedy rows keep their argmax
        logprobs = None
        if want_logprobs:
            # log_softmax gathered at the chosen ids, without materialising [B, V] log-probabilities.
            chosen = processed.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
            logprobs = chosen - torch.logsumexp(processed, dim=-1)  # [B]
        return SampleResult(tokens, logprobs)

    def process_logits(
        self, logits: Tensor, params: Sequence[SamplingParams], history: History | None = None
    ) -> Tensor:
        """[B, V] logits → [B, V] fp32 processed logits (removed tokens are -inf).

        Every row gets its repetition penalty; sampled rows then get temperature, top-k and top-p. Greedy rows
        stop after the penalty: their processed distribution is "argmax of these logits".
        """
        x = logits.float()  # [B, V]; every step below returns a new tensor, the caller's logits stay intact
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if penalized:
            if history is None:
                raise ValueError("repetition_penalty needs the history of ids (prompt + generated) per row")
            x = self._apply_repetition_penalty(x, params, history, penalized)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return x
        if len(sampled) == len(params):
            return self._warp(x, [params[i] for i in sampled])
        rows = torch.tensor(sampled, device=x.device)  # [S]
        return x.index_copy(0, rows, self._warp(x.index_select(0, rows), [params[i] for i in sampled]))

    def processed_probs(
        self, logits: Tensor, params: Sequence[SamplingParams], history: History | None = None
    ) -> Tensor:
        """[B, V] → [B, V] fp32 probabilities each row's next token is drawn from.

        For greedy rows that is a one-hot vector on the argmax (the zero-temperature limit), which is exactly what
        speculative verification needs: a draft token is accepted with probability p(token) / q(token).
        """
        x = self.process_logits(logits, params, history)  # [B, V]
        probs = torch.softmax(x, dim=-1)  # [B, V]
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=x.device)  # [G]
            one_hot = torch.zeros((len(greedy_rows), x.shape[-1]), dtype=probs.dtype, device=x.device)
            one_hot.scatter_(1, greedy(x.index_select(0, rows))[:, None], 1.0)  # [G, V]
            probs = probs.index_copy(0, rows, one_hot)
        return probs

    def draw(self, probs: Tensor, generators: Sequence[Generator | None]) -> Tensor:
        """[B, V] probabilities (any non-negative weights) → [B] int64 ids, one uniform per row from that row's
        generator. For speculative decoding's residual distributions, e.g. normalise(max(0, p - q))."""
        if len(generators) != probs.shape[0]:
            raise ValueError(f"got {len(generators)} generators for a batch of {probs.shape[0]} rows")
        return _inverse_cdf(probs.float(), uniforms(generators, probs.device))

    # ---- the steps ----------------------------------------------------------------------------------------------
    def _apply_repetition_penalty(
        self, x: Tensor, params: Sequence[SamplingParams], history: History, rows: list[int]
    ) -> Tensor:
        """Every id seen in a row's history: logit / penalty if positive, logit * penalty if negative.

        Like HF: gather the seen ids' logits, rescale them, scatter them back (duplicates write equal values)."""
        seen = {i: _as_ids(history[i], x.device) for i in rows}
        rows = [i for i in rows if seen[i].numel() > 0]
        if not rows:
            return x
        # Pad every row with its own first id: re-penalising a seen id with the value it already got is harmless.
        padded = torch.nn.utils.rnn.pad_sequence([seen[i] for i in rows], batch_first=True, padding_value=-1)
        padded = torch.where(padded < 0, padded[:, :1], padded)  # [R, L]
        penalty = torch.tensor([params[i].repetition_penalty for i in rows], dtype=x.dtype, device=x.device)
        penalty = penalty[:, None]  # [R, 1]
        every_row = len(rows) == x.shape[0]
        idx = None if every_row else torch.tensor(rows, device=x.device)  # [R]
        sub = x.clone() if idx is None else x.index_select(0, idx)  # [R, V], a copy either way
        score = sub.gather(1, padded)  # [R, L]
        score = torch.where(score < 0, score * penalty, score / penalty)
        sub.scatter_(1, padded, score)
        return sub if idx is None else x.index_copy(0, idx, sub)

    def _warp(self, x: Tensor, params: Sequence[SamplingParams]) -> Tensor:
        """Temperature, then top-k, then top-p, for rows that all sample. x: [S, V]."""
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            x = x / torch.tensor(temps, dtype=x.dtype, device=x.device)[:, None]  # [S, V]
        ks = [p.top_k for p in params]
        if any(k > 0 for k in ks):
            x = _top_k(x, ks)
        ps = [p.top_p for p in params]
        if any(p < 1.0 for p in ps):
            x = _top_p(x, ps)
        return x


def _as_ids(ids: Tensor | Sequence[int], device: torch.device) -> Tensor:
    if isinstance(ids, Tensor):
        return ids.to(device=device, dtype=torch.long).reshape(-1)
    return torch.tensor(list(ids), dtype=torch.long, device=device)


def _top_k(x: Tensor, ks: list[int]) -> Tensor:
    """Keep, per row, every logit >= that row's k-th largest (ties at the boundary survive, as in HF).

    x: [S, V]; ks[i] == 0 leaves row i alone.
    """
    v = x.shape[-1]
    kk = [min(k, v) for k in ks]
    kmax = max(kk)
    top = torch.topk(x, kmax, dim=-1).values  # [S, kmax], sorted descending
    pick = torch.tensor([max(k, 1) - 1 for k in kk], device=x.device)[:, None]  # [S, 1]
    threshold = top.gather(-1, pick)  # [S, 1]
    off = torch.tensor([k == 0 for k in kk], device=x.device)[:, None]  # [S, 1]
    threshold = threshold.masked_fill(off, -math.inf)
    return x.masked_fill(x < threshold, -math.inf)


def _top_p(x: Tensor, ps: list[float]) -> Tensor:
    """Nucleus filter with HF's rule: a token goes when the probability of everything less likely than it, itself
    included, is <= 1 - top_p; the most likely token always stays. x: [S, V]; rows with top_p == 1 are left alone.

    Sorting the whole vocabulary (HF's way) costs far more than the rest of a sampling step on CPU, so the nucleus
    is first looked for among the ``_TOP_P_CANDIDATES`` most likely tokens: there the rule reads "keep a token
    while the mass strictly above it is < top_p". Rows whose nucleus is larger fall back to the full sort.
    Tokens tied with the last kept one all stay (HF's sort would keep an arbitrary subset of them).
    """
    v = x.shape[-1]
    if v <= _TOP_P_CANDIDATES:
        return _top_p_sorted(x, ps)
    top = torch.tensor(ps, dtype=x.dtype, device=x.device)[:, None]  # [S, 1]
    vals, _ = torch.topk(x, _TOP_P_CANDIDATES, dim=-1)  # [S, C], descending
    probs = torch.exp(vals - torch.logsumexp(x, dim=-1, keepdim=True))  # [S, C]
    above = probs.cumsum(dim=-1) - probs  # [S, C]: mass of the candidates strictly more likely
    off = torch.tensor([p >= 1.0 for p in ps], device=x.device)[:, None]  # [S, 1]
    keep = (above < top) | off  # [S, C]; a prefix of each row
    n_keep = keep.sum(dim=-1, keepdim=True)  # [S, 1], >= 1
    threshold = vals.gather(-1, n_keep - 1)  # [S, 1]: the least likely kept value
    threshold = threshold.masked_fill(off, -math.inf)
    out = x.masked_fill(x < threshold, -math.inf)
    spill = [i for i, p in enumerate(ps) if p < 1.0 and bool(keep[i, -1])]  # nucleus may extend past the candidates
    if spill:
        rows = torch.tensor(spill, device=x.device)  # [F]
        out = out.index_copy(0, rows, _top_p_sorted(x.index_select(0, rows), [ps[i] for i in spill]))
    return out


def _top_p_sorted(x: Tensor, ps: list[float]) -> Tensor:
    """HF's nucleus filter verbatim in behaviour: full ascending sort and cumulative sum. x: [S, V]."""
    sorted_logits, sorted_idx = torch.sort(x, descending=False)  # [S, V] each
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [S, V]
    # 1 - top_p is formed in Python float and rounded to x.dtype once, as HF's scalar comparison does.
    floor = torch.tensor([1 - p for p in ps], dtype=x.dtype, device=x.device)[:, None]  # [S, 1]
    active = torch.tensor([p < 1.0 for p in ps], device=x.device)[:, None]  # [S, 1]
    remove_sorted = (cum <= floor) & active  # [S, V]
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)  # [S, V], back in vocabulary order
    return x.masked_fill(remove, -math.inf)


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """probs: [S, V], u: [S] in [0, 1) → [S] int64 ids, id i drawn with probability probs[:, i].

    Two levels, so no full-vocabulary scan is needed: per-block masses (summed in float64) pick the block, then
    a cumulative sum inside that one block picks the id.
    """
    s, v = probs.shape
    pad = (-v) % _CDF_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = blocks.view(s, -1, _CDF_BLOCK)  # [S, NB, BLK]
    mass = blocks.sum(dim=-1, dtype=torch.float64)  # [S, NB]
    cdf = mass.cumsum(dim=-1)  # [S, NB]
    target = u * cdf[:, -1]  # [S]
    b = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)  # [S, 1]
    rest = target[:, None] - (cdf.gather(-1, b) - mass.gather(-1, b))  # [S, 1]: mass left inside block b
    inner = blocks.gather(1, b[:, :, None].expand(s, 1, _CDF_BLOCK)).squeeze(1)  # [S, BLK]
    j = torch.searchsorted(inner.double().cumsum(dim=-1), rest, right=True).clamp_(max=_CDF_BLOCK - 1)  # [S, 1]
    # Rounding (u * total == total, or block sums vs in-block sums) can step onto a zero-probability id; then take
    # the block's most likely id instead (an event of probability ~1e-16).
    ok = inner.gather(-1, j) > 0  # [S, 1]
    j = torch.where(ok, j, inner.argmax(dim=-1, keepdim=True))
    return (b * _CDF_BLOCK + j).squeeze(-1)
