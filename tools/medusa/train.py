"""Self-distilled v2 Medusa heads: the frozen base model's own greedy text is the training data.

The targets: for a response ``r_1 .. r_T`` generated greedily after a prompt, the base model's final hidden state
``h_j`` at the position that produced ``r_{j+1}`` (``h_0`` is the prompt's last position) is paired with
``r_{j+h+2}`` for head ``h``: the base ``lm_head`` predicts one token ahead, head ``h`` ``h + 2`` ahead. The base
model stays frozen and runs once (``teacher_hidden``, no gradient); training touches only the heads' residual blocks
and costs a few passes over ``[M, H]`` states.

Two losses, in order. First a cheap regression in hidden space: the base model's own state ``h_{j+h+1}`` is a
vector whose ``lm_head`` argmax is exactly ``r_{j+h+2}``, so head ``h`` at ``h_j`` is pulled towards it (MSE,
no vocabulary matmul). Then cross-entropy through the frozen ``lm_head`` against ``r_{j+h+2}``, over the
vocabulary the corpus uses (``vocab``: the logits of other ids are left out of the softmax to keep a CPU epoch
short; ``head_accuracy`` measures top-1 over the full vocabulary, so the shortcut cannot flatter the result).
Blocks start at zero weight (an identity block, as in the reference Medusa).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from service.adapters.medusa.heads import MedusaHeads, residual_blocks
from service.model import KVCache, Llama

__all__ = ["IGNORE", "head_accuracy", "head_dataset", "teacher_hidden", "train_v2_heads"]

IGNORE = -1


def teacher_hidden(
    model: Llama, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, batch_size: int = 16
) -> list[Tensor]:
    """The base model's final-normed hidden states at the positions that predict each response token.

    Runs ``prompt + response[:-1]`` teacher-forced (one prefill per batch, right-padded); returns per sequence a
    [len(response), H] tensor (row ``j`` predicts ``response[j]``), on the CPU in fp32.
    """
    out: list[Tensor] = []
    dev = model.device
    for start in range(0, len(prompts), batch_size):
        chunk = range(start, min(start + batch_size, len(prompts)))
        seqs = [list(prompts[i]) + list(responses[i][:-1]) for i in chunk]
        longest = max(len(s) for s in seqs)
        tokens = torch.zeros(len(seqs), longest, dtype=torch.long, device=dev)  # [b, T]
        for row, seq in enumerate(seqs):
            tokens[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        positions = torch.arange(longest, device=dev)[None, :].expand(len(seqs), longest)  # [b, T]
        cache = KVCache(model.cfg, len(seqs), longest, dtype=model.dtype, device=dev)
        hidden = model(tokens, positions, cache, 0, kv_len=longest)  # [b, T, H]
        for row, i in enumerate(chunk):
            p, t = len(prompts[i]), len(responses[i])
            out.append(hidden[row, p - 1 : p - 1 + t].float().cpu().clone())  # [t, H]
    return out


def head_dataset(
    hiddens: Sequence[Tensor], responses: Sequence[Sequence[int]], num_heads: int
) -> tuple[Tensor, Tensor]:
    """Stack every position: x [M, H] and targets y [M, num_heads] (``IGNORE`` past a response's end)."""
    xs, ys = [], []
    for hidden, response in zip(hiddens, responses, strict=True):
        t = len(response)
        r = torch.tensor(list(response), dtype=torch.long)  # [t]
        y = torch.full((t, num_heads), IGNORE, dtype=torch.long)  # [t, n]
        for h in range(num_heads):
            shift = h + 1  # hidden j predicts r[j]; head h predicts r[j + h + 1]
            if t > shift:
                y[: t - shift, h] = r[shift:]
        xs.append(hidden)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def _shifted_states(x: Tensor, y: Tensor, lengths: Sequence[int], num_heads: int) -> Tensor:
    """[M, n, H]: for row j of a sequence, the base state h_{j+h+1} (zeros where there is none)."""
    target = torch.zeros(x.shape[0], num_heads, x.shape[1])
    start = 0
    for t in lengths:
        for h in range(num_heads):
            shift = h + 1
            if t > shift:
                target[start : start + t - shift, h] = x[start + shift : start + t]
        start += t
    return target


def train_v2_heads(
    x: Tensor,
    y: Tensor,
    lm_head: Tensor,
    *,
    lengths: Sequence[int],
    num_layers: int = 1,
    mse_epochs: int = 2,
    ce_epochs: int = 2,
    batch_size: int = 256,
    lr: float = 1e-3,
    head_decay: float = 0.8,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> tuple[Tensor, Tensor]:
    """Train the residual blocks of ``y.shape[1]`` v2 heads; returns block_weight [L, n, H, H], block_bias [L, n, H].

    x [M, H] fp32 base states, y [M, n] targets (``IGNORE`` = none), lm_head [V, H] frozen. ``lengths``: the
    response length of each sequence ``x`` was stacked from (for the hidden-space targets). Head ``h``'s loss is
    weighted ``head_decay ** h``, as in the reference training.
    """
    n, hidden = y.shape[1], x.shape[1]
    gen = torch.Generator().manual_seed(seed)
    weight = torch.zeros(num_layers, n, hidden, hidden, requires_grad=True)
    bias = torch.zeros(num_layers, n, hidden, requires_grad=True)
    head_w = torch.tensor([head_decay**h for h in range(n)])  # [n]
    lm_sub, y_sub = _corpus_vocabulary(lm_head.detach().float(), y)  # [Vs, H], [M, n]
    states = _shifted_states(x, y, lengths, n)  # [M, n, H]
    has_target = y != IGNORE  # [M, n]

    total = mse_epochs + ce_epochs
    steps = total * math.ceil(x.shape[0] / batch_size)
    opt = torch.optim.AdamW([weight, bias], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1), pct_start=0.05)
    for epoch in range(total):
        t0 = time.perf_counter()
        perm = torch.randperm(x.shape[0], generator=gen)
        running, count = 0.0, 0
        for start in range(0, x.shape[0], batch_size):
            idx = perm[start : start + batch_size]
            out = residual_blocks(x[idx], weight, bias)  # [b, n, H]
            mask = has_target[idx]  # [b, n]
            if epoch < mse_epochs:
                err = (out - states[idx]).pow(2).mean(-1)  # [b, n]
                loss = (err * mask * head_w).sum() / mask.sum().clamp(min=1)
            else:
                loss = (_cross_entropy(out, lm_sub, y_sub[idx]) * head_w).sum() / mask.sum().clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
            running += float(loss.detach()) * idx.numel()
            count += idx.numel()
        if log is not None:
            kind = "mse" if epoch < mse_epochs else "ce"
            log(f"epoch {epoch + 1}/{total} ({kind}) loss={running / count:.4f} ({time.perf_counter() - t0:.1f}s)")
    return weight.detach().clone(), bias.detach().clone()


def _corpus_vocabulary(lm: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """lm [V, H], y [M, n] -> the rows of ``lm`` for the ids the corpus uses [Vs, H], and y in those ids [M, n]."""
    vocab = torch.unique(y[y != IGNORE])  # [Vs]
    remap = torch.full((lm.shape[0],), IGNORE, dtype=torch.long)
    remap[vocab] = torch.arange(vocab.numel())
    return lm[vocab], torch.where(y == IGNORE, IGNORE, remap[y.clamp(min=0)])


def _cross_entropy(out: Tensor, lm_sub: Tensor, y_sub: Tensor) -> Tensor:
    """out [b, n, H] head states, lm_sub [Vs, H], y_sub [b, n] -> per-head cross-entropy [b, n] (0 where IGNORE)."""
    logits = F.linear(out, lm_sub)  # [b, n, Vs]
    ce = F.cross_entropy(logits.reshape(-1, lm_sub.shape[0]), y_sub.reshape(-1), ignore_index=IGNORE, reduction="none")
    return ce.view(y_sub.shape)


def head_accuracy(heads: MedusaHeads, x: Tensor, y: Tensor, lm_head: Tensor, *, batch_size: int = 512) -> list[float]:
    """Top-1 accuracy of each head over the full vocabulary, on the rows that have a target."""
    hits = torch.zeros(heads.num_heads)
    seen = torch.zeros(heads.num_heads)
    for start in range(0, x.shape[0], batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        pred = heads.draft(xb.to(heads.device), lm_head).cpu()  # [b, n]
        mask = yb != IGNORE
        hits += ((pred == yb) & mask).sum(0).float()
        seen += mask.sum(0).float()
    return (hits / seen.clamp(min=1)).tolist()  # type: ignore[no-any-return]
