"""A batched greedy generation loop over ``service.model`` with optional Medusa speculation: the reference.

This is what tests and ``bench/medusa.py`` compare against and measure with, and a blueprint for the engine: no
scheduler, no streaming, every request admitted at once. Rows are kept compacted in KV slots ``0..m-1``; a
finished row's slot is filled by moving the last row into it (``KVCache.move``). One step:

1. every active row feeds its pending token plus its drafts (``k_b`` of them; ``0`` for a row without heads, or for
   every row when more than ``speculate_max_batch`` rows are active) at positions ``L_b .. L_b + k_b``; rows are
   padded to the longest, and the padding's K/V lands beyond the row's new length where it is never read;
2. one forward pass, fp32 logits at every fed position, ``verify_greedy``;
3. each row keeps ``accepted + 1`` tokens (cut at an end-of-sequence id or ``max_new_tokens``), its length becomes
   ``L_b + 1 + accepted`` (that is the whole KV rollback), and its heads draft the next ``k`` tokens from the
   hidden state at the last accepted position.

With ``heads=None`` (or ``speculate_max_batch=0``) every step is a plain one-token greedy step, so the same loop
is the non-speculative baseline. ``adapters(rows)`` returns the model's adapter hook for one forward pass over the
requests ``rows`` (indices into ``prompts``, in slot order), e.g. a LoRA ``AdapterBatch``; heads and LoRA of a
Medusa + LoRA adapter are then both applied.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from service.adapters.medusa.heads import MedusaHeads
from service.model import AdapterHook, KVCache, Llama
from tools.medusa.speculative import verify_greedy

__all__ = ["Generation", "GenerationStats", "generate"]

AdapterHookFactory = Callable[[Sequence[int]], AdapterHook | None]


@dataclass
class GenerationStats:
    steps: int = 0  # forward passes after the prefill
    row_steps: int = 0  # sum over steps of the rows in the step
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    verified_tokens: int = 0  # tokens produced by verification steps (accepted + 1 per row-step), before cuts
    new_tokens: int = 0  # tokens returned (after end-of-sequence / max_new_tokens cuts), prefill's first included
    decode_tokens: int = 0  # new_tokens minus the one token per row that the prefill produced
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a row gains per decode step (1.0 without speculation)."""
        return self.verified_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first of each row, per second of decoding."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt (an end-of-sequence id is included, as transformers does)
    stats: GenerationStats = field(default_factory=GenerationStats)
    hidden: list[torch.Tensor] | None = None  # with record_hidden: per prompt [len(tokens), H], row j produced token j


@dataclass
class _Row:
    index: int  # into prompts
    length: int  # KV positions [0, length) are committed
    pending: int  # emitted, not yet fed to the model
    out: list[int]
    heads: MedusaHeads | None
    drafts: list[int] = field(default_factory=list)
    done: bool = False
    states: list[torch.Tensor] = field(default_factory=list)  # record_hidden: [t, H] blocks, one per step


def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    heads: MedusaHeads | Sequence[MedusaHeads | None] | None = None,
    eos_token_ids: Collection[int] = (),
    adapters: AdapterHookFactory | None = None,
    speculate_max_batch: int | None = None,
    draft_threshold: float = 0.0,
    cache: KVCache | None = None,
    record_hidden: bool = False,
) -> Generation:
    """Greedy decoding of every prompt, speculative for rows with heads (see the module docstring).

    ``draft_threshold``: verify a row's draft ``i`` only while the product of the heads' probabilities of drafts
    ``1..i`` (the chance, if the heads are calibrated, that all of them are accepted) is at least this; 0 verifies
    every draft. Unlikely drafts cost verification compute and almost never pay.
    ``cache``: use this KV cache (slots ``0..len(prompts)-1``) instead of a fresh one, e.g. to inspect it after.
    ``record_hidden``: also return, per prompt, the final hidden state that produced each new token (training data
    for heads: ``tools.medusa.train``), on the CPU in fp32.
    """
    n = len(prompts)
    if n == 0:
        return Generation([])
    per_row, cache = _setup(model, prompts, max_new_tokens, heads, cache)
    run = _Run(model, cache, frozenset(eos_token_ids), max_new_tokens, adapters, speculate_max_batch, draft_threshold,
               record_hidden)  # fmt: skip
    stats = GenerationStats()
    with torch.inference_mode():
        t0 = time.perf_counter()
        rows, active, order = _prefill(run, prompts, per_row)
        _sync(model.device)
        stats.prefill_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        while active:
            active = _step(run, active, order, stats)
        _sync(model.device)
        stats.decode_seconds = time.perf_counter() - t0
    out = [r.out for r in rows]
    stats.new_tokens = sum(len(t) for t in out)
    stats.decode_tokens = stats.new_tokens - n
    hiddens = [torch.cat(r.states) for r in rows] if record_hidden else None
    return Generation(out, stats, hiddens)


@dataclass(frozen=True)
class _Run:
    """What every step of one ``generate`` call shares."""

    model: Llama
    cache: KVCache
    eos: frozenset[int]
    max_new_tokens: int
    adapters: AdapterHookFactory | None
    speculate_max_batch: int | None
    draft_threshold: float
    record_hidden: bool

    def speculate(self, rows: Sequence[_Row]) -> bool:
        return self.speculate_max_batch is None or sum(not r.done for r in rows) <= self.speculate_max_batch


def _setup(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    heads: MedusaHeads | Sequence[MedusaHeads | None] | None,
    cache: KVCache | None,
) -> tuple[list[MedusaHeads | None], KVCache]:
    """Check the arguments; each row's heads, and a cache big enough for every row's worst case."""
    n = len(prompts)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    per_row = list(heads) if isinstance(heads, Sequence) else [heads] * n
    if len(per_row) != n:
        raise ValueError(f"got {len(per_row)} heads entries for {n} prompts")
    k_max = max((h.num_heads for h in per_row if h is not None), default=0)
    need = max(len(p) for p in prompts) + max_new_tokens + k_max + 1
    if cache is None:
        cache = KVCache(model.cfg, n, need, dtype=model.dtype, device=model.device)
    elif cache.slots < n or cache.max_len < need:
        raise ValueError(f"the cache needs >= {n} slots of >= {need} positions, has {cache.slots} x {cache.max_len}")
    return per_row, cache


def _prefill(
    run: _Run, prompts: Sequence[Sequence[int]], per_row: list[MedusaHeads | None]
) -> tuple[list[_Row], list[_Row], list[int]]:
    """Every prompt in one right-padded forward pass: (all rows, the active ones, request index of each slot)."""
    model, dev, n = run.model, run.model.device, len(prompts)
    longest = max(len(p) for p in prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)  # [n]
    tokens = torch.zeros(n, longest, dtype=torch.long, device=dev)  # [n, P], right-padded
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
    positions = torch.arange(longest, device=dev)[None, :].expand(n, longest)  # [n, P]
    order = list(range(n))  # request index of each slot
    hook = run.adapters(list(order)) if run.adapters is not None else None
    hidden = Llama.gather_last(model(tokens, positions, run.cache, 0, hook, kv_len=longest), lengths)  # [n, H]
    first = model.logits(hidden, hook).argmax(dim=-1).tolist()  # [n]
    rows = [_Row(i, len(prompts[i]), first[i], [first[i]], per_row[i]) for i in range(n)]
    for b, row in enumerate(rows):
        row.done = row.pending in run.eos or run.max_new_tokens == 1
        if run.record_hidden:
            row.states.append(hidden[b : b + 1].float().cpu())
    _draft(model, rows, hidden, run.speculate(rows), run.draft_threshold)
    return rows, _retire(run.cache, rows, order), order


def _step(run: _Run, active: list[_Row], order: list[int], stats: GenerationStats) -> list[_Row]:
    """One verification step over the active rows (slots ``0..m-1``); returns the rows still active."""
    model, dev, m = run.model, run.model.device, len(active)
    ks = [min(len(r.drafts), run.max_new_tokens - len(r.out) - 1) for r in active]
    k = max(ks)
    fed = [[r.pending, *r.drafts[: ks[b]]] + [r.pending] * (k - ks[b]) for b, r in enumerate(active)]
    tokens = torch.tensor(fed, dtype=torch.long, device=dev)  # [m, k+1]
    starts = torch.tensor([r.length for r in active], device=dev)  # [m]
    positions = starts[:, None] + torch.arange(k + 1, device=dev)[None, :]  # [m, k+1]
    hook = run.adapters(list(order)) if run.adapters is not None else None
    kv_len = max(r.length for r in active) + k + 1
    hidden = model(tokens, positions, run.cache, 0, hook, kv_len=kv_len)  # [m, k+1, H]
    logits = model.logits(hidden, hook)  # [m, k+1, V]
    verified = verify_greedy(tokens[:, 1:], logits, torch.tensor(ks, device=dev))
    accepted = verified.accepted.tolist()
    emitted = verified.tokens.tolist()
    stats.steps += 1
    stats.row_steps += m
    stats.drafted += sum(ks)
    stats.accepted += sum(accepted)
    stats.verified_tokens += sum(accepted) + m
    for b, row in enumerate(active):
        a = accepted[b]
        row.length += 1 + a
        row.pending = emitted[b][a]
        before = len(row.out)
        for token in emitted[b][: a + 1]:
            row.out.append(token)
            if token in run.eos or len(row.out) >= run.max_new_tokens:
                row.done = True
                break
        if run.record_hidden:
            row.states.append(hidden[b, : len(row.out) - before].float().cpu())  # [kept, H]
    at = verified.accepted.to(dev)  # [m]
    last = hidden[torch.arange(m, device=dev), at]  # [m, H]: the state after the last kept token
    _draft(model, active, last, run.speculate(active), run.draft_threshold)
    return _retire(run.cache, active, order)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _draft(model: Llama, rows: list[_Row], hidden: torch.Tensor, speculate: bool, threshold: float) -> None:
    """Set each unfinished row's drafts from ``hidden`` [len(rows), H], one call per distinct heads object."""
    groups: dict[int, list[int]] = {}
    for b, row in enumerate(rows):
        row.drafts = []
        if speculate and not row.done and row.heads is not None:
            groups.setdefault(id(row.heads), []).append(b)
    for members in groups.values():
        heads = rows[members[0]].heads
        if heads is None:  # never: groups hold rows with heads only
            continue
        idx = torch.tensor(members, device=hidden.device)
        x = hidden.index_select(0, idx)  # [g, H]
        head = model.draft_head(len(members) * heads.num_heads)
        if threshold > 0:
            ids, probs = heads.draft_with_confidence(x, head)  # [g, n_heads] each
            keep = (probs.cumprod(dim=1) >= threshold).sum(dim=1).tolist()  # cumprod falls, so a prefix passes
            drafts = [d[:k] for d, k in zip(ids.tolist(), keep, strict=True)]
        else:
            drafts = heads.draft(x, head).tolist()  # [g, n_heads]
        for b, d in zip(members, drafts, strict=True):
            rows[b].drafts = d


def _retire(cache: KVCache, rows: list[_Row], order: list[int]) -> list[_Row]:
    """Drop finished rows, moving the last active row into each hole; ``order`` (slot -> request) follows."""
    active = list(rows)
    slot = 0
    while slot < len(active):
        if active[slot].done:
            last = len(active) - 1
            if slot != last:
                cache.move(last, slot, active[last].length)
                active[slot] = active[last]
                order[slot] = order[last]
            active.pop()
            order.pop()
        else:
            slot += 1
    return active
