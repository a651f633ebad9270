"""Speculative verification of one draft chain per row: which drafts a row keeps, and the token it emits after.

The reference form, used by ``loop`` and the tests; the server verifies draft trees itself (``service.engine``
with ``service.drafters.tree``) and never imports this module.

One verification step of a row: its KV cache holds positions ``[0, L)``; the model has just run the row's pending
token ``t`` at position ``L`` followed by its ``k`` drafts ``d_1 .. d_k`` at ``L+1 .. L+k`` in one forward pass,
so ``logits[:, i]`` is the model's next-token distribution after ``t, d_1 .. d_i``. Draft ``d_{i+1}`` is checked
against ``logits[:, i]``; the row keeps the longest accepted prefix ``d_1 .. d_a`` and then emits one token drawn
from ``logits[:, a]`` (a correction after a rejection, a bonus when all ``k`` were accepted). ``tokens[b, :a+1]``
are the row's new tokens (``PAD`` after them). The caller then sets the row's length to ``L + 1 + a`` (the KV of
``t`` and of the accepted drafts stays; whatever lies beyond is never read again and will be overwritten) and makes
``tokens[b, a]`` the next pending token. ``num_drafts[b]`` (default ``k``) caps a row's drafts, so rows with fewer
heads or none (``0``: a plain decode step) share the batch; drafts past a row's cap are ignored.

Greedy (``verify_greedy``): draft ``d_{i+1}`` is accepted iff it equals ``argmax(logits[:, i])``; every emitted
token is then the argmax after its own prefix, so the output is token-identical to plain greedy decoding (the
logits of the ``k+1`` verified positions equal those of one-at-a-time decoding up to float rounding; ties break to
the lowest id in both).

Sampling (``verify_sampling``) is speculative sampling with a deterministic proposal. Medusa drafts are top-1
proposals, i.e. the draft distribution is ``q = one_hot(x)``. The general rule (Leviathan et al. 2023, Chen et al.
2023) accepts ``x`` with probability ``min(1, p(x) / q(x)) = p(x)`` and otherwise samples from the residual
``normalise(max(0, p - q))``, which for a one-hot ``q`` is ``p`` with ``x`` removed and renormalised. The emitted
token is then distributed exactly as ``p``: ``P(y = x) = p(x)`` (accepted) and, for ``y != x``,
``P(y) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y)``. Applied position by position (each later position is only reached
after acceptance, and conditioned on that prefix its distribution is again the target's), every emitted sequence
has exactly the distribution of sampling one token at a time from the same processed distributions ``p`` (after
temperature / top-k / top-p / penalties, which the caller applies per position). What is *not* preserved is the
random stream: a seeded request draws ``k + 1`` uniforms per step (``k`` acceptance tests, one final draw), so its
tokens differ from a non-speculative run with the same seed, while having the same distribution. A greedy row's
``p`` is one-hot on its argmax, for which this rule reduces to ``verify_greedy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PAD", "Verified", "draw_uniforms", "verify_greedy", "verify_sampling"]

PAD = -1


@dataclass(frozen=True)
class Verified:
    """The outcome of one verification step for every row."""

    accepted: Tensor  # [B] int64: drafts kept, 0..num_drafts[b]
    tokens: Tensor  # [B, k+1] int64: tokens[b, :accepted[b] + 1] to emit, PAD after

    @property
    def emitted(self) -> Tensor:
        """[B] int64: tokens each row emits this step (accepted + 1)."""
        return self.accepted + 1


def _check(draft: Tensor, scores: Tensor, num_drafts: Tensor | None) -> None:
    if draft.dim() != 2 or scores.dim() != 3:
        raise ValueError(
            f"draft must be [B, k] and scores [B, k+1, V], got {tuple(draft.shape)}, {tuple(scores.shape)}"
        )
    b, k = draft.shape
    if scores.shape[:2] != (b, k + 1):
        raise ValueError(
            f"scores {tuple(scores.shape)} do not fit drafts {tuple(draft.shape)}: expected [{b}, {k + 1}, V]"
        )
    if num_drafts is not None and tuple(num_drafts.shape) != (b,):
        raise ValueError(f"num_drafts must be [{b}], got {tuple(num_drafts.shape)}")


def _accepted_prefix(ok: Tensor, num_drafts: Tensor | None) -> Tensor:
    """ok [B, k] bool (draft i passes its test) -> [B] length of the leading run of passes, capped by num_drafts."""
    k = ok.shape[1]
    if num_drafts is not None:
        ok = ok & (torch.arange(k, device=ok.device)[None, :] < num_drafts[:, None])  # [B, k]
    return ok.long().cumprod(dim=1).sum(dim=1)  # [B]


def _emit(draft: Tensor, last: Tensor, accepted: Tensor) -> Tensor:
    """[B, k+1]: the accepted drafts, then ``last`` at index ``accepted``, PAD after."""
    b, k = draft.shape
    idx = torch.arange(k + 1, device=draft.device)[None, :]  # [1, k+1]
    padded = torch.cat([draft, draft.new_full((b, 1), PAD)], dim=1)  # [B, k+1]
    tokens = torch.where(idx < accepted[:, None], padded, PAD)
    return tokens.scatter(1, accepted[:, None], last[:, None])


def verify_greedy(draft: Tensor, logits: Tensor, num_drafts: Tensor | None = None) -> Verified:
    """Accept the longest prefix of ``draft`` [B, k] that matches ``argmax(logits[:, :k])``; emit the argmax after it.

    logits: [B, k+1, V] (any float dtype); num_drafts: [B] int64 or None (= k for every row).
    """
    _check(draft, logits, num_drafts)
    target = logits.argmax(dim=-1)  # [B, k+1]
    accepted = _accepted_prefix(draft == target[:, :-1], num_drafts)  # [B]
    last = target.gather(1, accepted[:, None]).squeeze(1)  # [B]
    return Verified(accepted, _emit(draft, last, accepted))


def draw_uniforms(generators: Sequence[torch.Generator | None], count: int, device: torch.device | str) -> Tensor:
    """[B, count] float64 U[0, 1) draws, row ``b`` from its own generator (torch's default one when None)."""
    rows = []
    for gen in generators:
        if gen is None:
            rows.append(torch.rand((count,), dtype=torch.float64))
        else:
            rows.append(torch.rand((count,), dtype=torch.float64, generator=gen, device=gen.device))
    return torch.stack([r.to(device) for r in rows]) if rows else torch.empty(0, count, dtype=torch.float64)


def verify_sampling(
    draft: Tensor,
    probs: Tensor,
    generators: Sequence[torch.Generator | None] | Tensor,
    num_drafts: Tensor | None = None,
) -> Verified:
    """Speculative sampling for top-1 drafts (see the module docstring): the output has the distribution ``probs``.

    draft: [B, k] int64; probs: [B, k+1, V] each row the processed distribution to sample from at that position
    (rows sum to 1; a greedy row's is one-hot); ``generators``: one per row (each draws ``k + 1`` uniforms), or a
    ready [B, k+1] float64 tensor of uniforms; num_drafts: [B] or None.
    """
    _check(draft, probs, num_drafts)
    b, k = draft.shape
    if isinstance(generators, Tensor):
        u = generators.to(device=probs.device, dtype=torch.float64)
        if tuple(u.shape) != (b, k + 1):
            raise ValueError(f"uniforms must be [{b}, {k + 1}], got {tuple(u.shape)}")
    else:
        if len(generators) != b:
            raise ValueError(f"got {len(generators)} generators for a batch of {b} rows")
        u = draw_uniforms(generators, k + 1, probs.device)  # [B, k+1]
    p_draft = probs[:, :k].gather(2, draft[:, :, None]).squeeze(2).double()  # [B, k]: p_i(d_{i+1})
    accepted = _accepted_prefix(u[:, :k] < p_draft, num_drafts)  # [B]
    final = probs.gather(1, accepted[:, None, None].expand(b, 1, probs.shape[2])).squeeze(1).double()  # [B, V]
    # Rejected rows sample from p with the rejected draft removed; rows that accepted all their drafts sample the
    # bonus token from p itself.
    cap = num_drafts if num_drafts is not None else torch.full_like(accepted, k)
    rejected = accepted < cap  # [B]
    if bool(rejected.any()):
        x = torch.cat([draft, draft.new_zeros(b, 1)], dim=1).gather(1, accepted[:, None])  # [B, 1]
        removed = final.scatter(1, x, 0.0)
        final = torch.where(rejected[:, None], removed, final)
    last = _inverse_cdf(final, u[:, k])  # [B]
    return Verified(accepted, _emit(draft, last, accepted))


def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """weights [B, V] >= 0 (float64, any positive total), u [B] in [0, 1) -> [B] ids drawn proportionally."""
    cdf = weights.cumsum(dim=1)  # [B, V]
    target = (u * cdf[:, -1])[:, None]  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[1] - 1)  # [B, 1]
    # Rounding can land on a zero-weight id at the very end of the CDF; step back to the last id with weight.
    ok = weights.gather(1, idx) > 0
    last_nonzero = (weights > 0).long().cumsum(dim=1).argmax(dim=1, keepdim=True)  # [B, 1]
    return torch.where(ok, idx, last_nonzero).squeeze(1)
