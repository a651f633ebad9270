"""What every layer of one forward pass shares (``Step``), built once per pass, and the choice of the fused step ops.

A float32 or bfloat16 model on the CPU runs its small per-layer ops on loraplex's compiled kernels when they are loaded
(``service.kernels.native``; ``--kernels``): residual add + RMSNorm and SiLU·mul in one call each, and for a decode
pass, a prefill, a draft chain or a draft tree RoPE, the K/V cache write and attention in one call per layer. Everything
else, and every other dtype or device, is the eager path; both agree within rounding (``tests/model``), and the
start-up self-check compares the fused ops against float32 references before serving (``service.selfcheck``).
The same kernels run the batched LoRA math of the model's adapter tables (``Llama.lora_native``,
``service.adapters.lora.batch``); ``native_ops`` chooses them for both. A pass of T tokens a row at consecutive
positions, each seeing the tokens before it (a prefill, a draft chain to verify), also carries ``pos`` beside its
mask, and a draft tree's also its mask in the kernel's form (``tree``): each token then attends as the decode step
after the tokens it sees would, in the one-call step (``service.model.decode_stack``) or from the per-op path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from service.kernels import KERNEL_DTYPES
from service.kernels.native import NativeKernels, kernels
from service.model.hooks import AdapterHook
from service.model.kv_cache import KVCache
from service.model.weights.protocol import Scratch

__all__ = ["Step", "fused_attention", "make_step", "native_ops", "visible"]


@dataclass(frozen=True)
class Step:
    """What every layer of one forward pass shares, computed once per pass."""

    cos: Tensor  # [B, T, 1, D] rope cos at each token's position
    sin: Tensor  # [B, T, 1, D] signed rope sin
    mask: Tensor | None  # [B, 1, T*G, L] additive (0 / -inf), rows ordered t*G + g (see Attention); None: ``pos``
    write_index: Tensor | None  # [B*T*2*KV] rows of KVCache.rows[layer] for this step's K and V; None: ``pos``
    adapters: AdapterHook | None
    scratch: Scratch  # where quantized projections are dequantized for a dense matmul (large M)
    native: NativeKernels | None = None  # the compiled step ops; a pass with ``pos`` (no mask) attends on them
    # [T B] int64 token-major cache positions, with ``native``: a decode pass (T = 1), a causal chain or a draft
    # tree (T > 1); None: the pass is none of them (torch's attention under the mask)
    pos: Tensor | None = None
    tree: Tensor | None = None  # with ``pos``, a draft tree's mask: bool [1 or B, T, T]; None: no tree, or a chain


def fused_attention(step: Step, qkv: Tensor, heads: int, k_cache: Tensor, v_cache: Tensor) -> Tensor | None:
    """qkv [B, T, H + 2 KV, D], the fused projection of a decode pass, a causal chain or a draft tree (``pos``) ->
    [B, T, H * D]:
    RoPE, the K/V writes and attention in one compiled call (k_cache, v_cache [B, KV, max_len, D]: the rows' slots);
    None where the pass has neither (the caller attends in torch ops under the mask). A chain's tokens go
    token-major, row t B + b in slot b, as in the one-call step (``service.model.decode_stack``): each token gets
    what a decode step of it alone gets, whichever of the two paths a pass takes (a neighbour's adapter may keep a
    pass off the one-call step), so a row's result does not depend on its neighbours."""
    native, pos = step.native, step.pos
    if native is None or pos is None:
        return None
    b, t, _, d = qkv.shape
    cos, sin = step.cos.view(b, t, d), step.sin.view(b, t, d)
    if t > 1:
        qkv, cos, sin = qkv.transpose(0, 1), cos.transpose(0, 1), sin.transpose(0, 1)
    q, c, s = (z.reshape(t * b, *z.shape[2:]).contiguous() for z in (qkv, cos, sin))
    y = native.decode_attention(q, c, s, pos, k_cache, v_cache, heads, slots=b, tree=step.tree)  # [T B, H * D]
    return y.view(t, b, -1).transpose(0, 1) if t > 1 else y.view(b, 1, -1)


def native_ops(dtype: torch.dtype, device: torch.device) -> NativeKernels | None:
    """The compiled kernels a model of ``dtype`` on ``device`` runs its step ops and its LoRA tables on: float32 or
    bfloat16 on the CPU; None: eager (on CUDA torch's own GPU kernels)."""
    return kernels() if dtype in KERNEL_DTYPES and device.type == "cpu" else None


def visible(positions: Tensor, length: int, tree: Tensor | None) -> Tensor:
    """[B, T, L] bool: which of the ``length`` cache positions each query attends to (see ``Llama.forward``)."""
    b, t = positions.shape
    key_pos = torch.arange(length, device=positions.device)  # [L]
    if tree is None:
        return key_pos <= positions[:, :, None]  # [B, T, L]: key position <= query position
    # The cache below the root, then the query's own ancestors among the nodes.
    rel = key_pos[None, :] - positions[:, :1]  # [B, L]: key position relative to the root
    in_tree = tree.to(positions.device).expand(b, t, t)  # [B, T, T]: one tree for every row, or one per row
    node = rel.clamp(0, t - 1)[:, None, :].expand(b, t, length)  # [B, T, L]
    return (rel < 0)[:, None, :] | ((rel < t)[:, None, :] & in_tree.gather(2, node))


def make_step(
    tables: tuple[Tensor, Tensor],
    positions: Tensor,
    slots_at: Tensor,
    length: int,
    *,
    cache: KVCache,
    slot_start: int,
    heads_per_kv: int,
    tree: Tensor | None,
    adapters: AdapterHook | None,
    scratch: Scratch,
    native: NativeKernels | None,
) -> Step:
    """The ``Step`` of a pass over ``positions`` [B, T] whose K/V go to cache positions ``slots_at``, attending to
    ``length`` keys; ``tables`` are the model's rope cos / sin [P, D]."""
    cos, sin = tables[0][positions].unsqueeze(2), tables[1][positions].unsqueeze(2)  # [B, T, 1, D]
    if native is not None and (fused := _token_major(positions, slots_at, tree)):  # no mask: the kernel attends
        return Step(cos, sin, None, None, adapters, scratch, native=native, **fused)
    seen = visible(positions, length, tree)  # [B, T, L]
    mask = torch.zeros(seen.shape, dtype=cos.dtype, device=positions.device).masked_fill_(~seen, -math.inf)
    return Step(
        cos=cos,
        sin=sin,
        mask=mask.repeat_interleave(heads_per_kv, dim=1).unsqueeze(1),  # [B, 1, T*G, L]
        write_index=cache.write_index(slot_start, slots_at),
        adapters=adapters,
        scratch=scratch,
        native=native,
    )


def _token_major(positions: Tensor, slots_at: Tensor, tree: Tensor | None) -> dict[str, Tensor | None]:
    """``Step.pos`` (and ``Step.tree``) for the compiled attention: token-major cache positions [T B] when the pass
    is a decode step (T = 1; a draft tree of the root alone too), a causal chain at consecutive positions (a prefill,
    or a draft chain: one tree for every row, each node seeing itself and the nodes before it) or a draft tree, each
    row's nodes at consecutive cache positions from its root (``Llama.forward``), with its mask; empty where the pass
    is none of them (the attention then runs in torch ops under the mask)."""
    b, t = positions.shape
    if t == 1:
        return {"pos": slots_at[:, 0].to(torch.int64).contiguous()} if tree is None or bool(tree.all()) else {}
    steps = torch.arange(t, device=positions.device)
    chain = tree is None or (
        tuple(tree.shape) == (t, t)
        and torch.equal(tree, torch.ones(t, t, dtype=torch.bool, device=tree.device).tril_())
        and torch.equal(positions, slots_at)
    )
    if not torch.equal(slots_at - slots_at[:, :1], steps.expand(b, t)):
        return {}
    pos = slots_at.t().reshape(-1).to(torch.int64).contiguous()
    if chain or tree is None:
        return {"pos": pos}
    marks = (tree if tree.dim() == 3 else tree[None]).to(device="cpu", dtype=torch.bool).contiguous()
    if not bool(marks.diagonal(dim1=1, dim2=2).all()):
        return {}
    return {"pos": pos, "tree": marks}
