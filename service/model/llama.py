"""A Llama-family decoder for serving: fused weights, a slot KV cache, attention masked by position.

Owns the forward pass and nothing else: parameters are allocated with ``torch.empty`` in their final, fused layout
(per layer ``wqkv`` = [q; k; v] rows, ``w13`` = [gate; up] rows, see ``ModelConfig.fused_rows``) and filled by
``service.model.load_folder`` / ``load_gguf``; a tied ``lm_head`` is the embedding tensor itself. A GGUF load may
swap the embedding for an ``EmbeddingTable`` (rows dequantized on gather; as the head, its own projection), see
``set_embeddings``.

A forward pass runs ``B`` rows that occupy the contiguous cache slots ``[slot_start, slot_start + B)``. Row ``b``
carries its tokens and their absolute positions; K/V are written at those positions, and each query attends to
the keys of its own slot at positions ``<=`` its own. Right-padded prompts, ``[B, 1]`` decode steps and rollback
(the engine just lowers its length) follow from that one rule; with ``tree`` the row's tokens are the nodes of a
Medusa draft tree at consecutive cache positions, each attending only to its ancestors (the verification step).
Values the cache stores are finite and bounded (``kv_cache.finite_kv``): a row never poisons the slot's next occupant.

``adapters`` is the seam for per-row adapters (``service.model.hooks``): projections go through ``proj``, norms
through ``normed``; the embedding and ``logits`` call it too. With ``quantized=True`` the four projections of a layer
are compact (``service.model.weights``: int8, int4): shape-only ``meta`` placeholders that the loader replaces one by
one (``set_projection``), never a dense copy; ``proj`` runs them through ``weights.protocol.linear`` with the model's
one reusable ``scratch`` and, on the CPU, the compiled kernels (``native``: dense products of a few rows too).
Weights are seen through ``service.model.weights.protocol`` only: this module knows no kind. Embeddings, norms,
biases and the ``lm_head`` stay dense. Nothing here implements an adapter, reads a file or keeps per-request state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.kernels.native import NativeKernels
from service.model.config import ModelConfig
from service.model.decode_stack import DecodeStack
from service.model.hooks import PROJ_NAMES, AdapterHook, HeadPart, NormName, ProjName
from service.model.kv_cache import KVCache, finite_kv
from service.model.rope import apply_rope, rope_inv_freq, rope_table
from service.model.step import Step, fused_attention, make_step, native_ops
from service.model.weights.protocol import EmbeddingTable, ProjWeight, Scratch, Weight, dense_head, linear
from service.platform import draft_dtype

__all__ = ["PROJ_NAMES", "AdapterHook", "Llama", "ProjName", "proj"]

# Logits per row recomputed in float32 after a reduced-precision head (``Llama.logits``).
EXACT_TOP = 8


def proj(
    x: Tensor,
    weight: ProjWeight,
    bias: Tensor | None,
    layer: int,
    name: ProjName,
    adapters: AdapterHook | None,
    *,
    scratch: Scratch | None = None,
    native: NativeKernels | None = None,
) -> Tensor:
    """One linear projection of the decoder (dense or compact ``weight``, see ``protocol.linear``), with the adapter
    delta added when a hook is given."""
    out = linear(x, weight, bias, scratch=scratch, native=native)
    if adapters is not None:
        out = adapters.add_delta(out, x, layer, name)
    return out


# --- modules --------------------------------------------------------------------------------------------


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _proj_weight(rows: int, cols: int, *, quantized: bool, dtype: torch.dtype, device: torch.device) -> ProjWeight:
    """A projection's weight: a dense parameter, or (quantized) a ``meta`` placeholder of its shape, no memory."""
    if quantized:
        return torch.empty(rows, cols, dtype=dtype, device="meta")
    return _param(rows, cols, dtype=dtype, device=device)


class RMSNorm(nn.Module):
    """Root-mean-square norm, accumulated in fp32 (``F.rms_norm`` upcasts reduced precisions internally). Takes the
    float32 residual stream of a reduced-precision model and returns the model dtype (see ``Llama.forward``)."""

    def __init__(self, dim: int, eps: float, name: NormName, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.name: NormName = name  # PEFT's name of the norm (what an adapter's modules_to_save replaces)
        self.weight = _param(dim, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.with_weight(x, self.weight)

    def with_weight(self, x: Tensor, w: Tensor) -> Tensor:
        """This norm with weight ``w`` (the module's own, or an adapter's replacement of it)."""
        if x.dtype == w.dtype:
            return F.rms_norm(x, w.shape, w, self.eps)
        return F.rms_norm(x, w.shape, w.to(x.dtype), self.eps).to(w.dtype)  # one rounding, after the scale


def normed(norm: RMSNorm, x: Tensor, layer: int, adapters: AdapterHook | None) -> Tensor:
    """``norm(x)``, with the rows whose adapter replaces the norm's weight normed with theirs."""
    out = norm(x)
    return out if adapters is None else adapters.norm(out, x, layer, norm.name, norm.with_weight)


def add_normed(
    norm: RMSNorm, x: Tensor, y: Tensor | None, layer: int, adapters: AdapterHook | None, native: NativeKernels | None
) -> tuple[Tensor, Tensor]:
    """The residual stream ``x + y`` (y None: x) and ``normed`` of it; the native ops fuse both, updating x in place."""
    if native is None or (y is not None and y.dtype != norm.weight.dtype):
        x = x if y is None else x + y
        return x, normed(norm, x, layer, adapters)
    out = native.add_rmsnorm(x, y, norm.weight, norm.eps)
    return x, out if adapters is None else adapters.norm(out, x, layer, norm.name, norm.with_weight)


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, *, dtype: torch.dtype, device: torch.device, quantized: bool = False
    ) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = cfg.num_heads
        self.n_kv = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        hidden, q_cols = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.wqkv: ProjWeight = _proj_weight(qkv_rows, hidden, quantized=quantized, dtype=dtype, device=device)
        self.wo: ProjWeight = _proj_weight(hidden, q_cols, quantized=quantized, dtype=dtype, device=device)
        self.bqkv: nn.Parameter | None = None
        self.bo: nn.Parameter | None = None
        if cfg.attention_bias:
            self.bqkv = _param(qkv_rows, dtype=dtype, device=device)
            self.bo = _param(cfg.hidden_size, dtype=dtype, device=device)

    def forward(self, x: Tensor, step: Step, kv_rows: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        # x [B, T, hidden]; kv_rows: this layer's cache, flat; k_cache/v_cache: [B, n_kv, max_len, D] (this batch).
        # narrow/transpose rather than [:, :, a:b]/permute: this runs 30+ times a step and each index is an op.
        b, t, _ = x.shape
        h, kv, d = self.n_head, self.n_kv, self.head_dim
        g = h // kv
        qkv = proj(x, self.wqkv, self.bqkv, self.layer, "wqkv", step.adapters, scratch=step.scratch, native=step.native)
        if (y := fused_attention(step, qkv.view(b, t, h + 2 * kv, d), h, k_cache, v_cache)) is not None:
            return proj(y, self.wo, self.bo, self.layer, "wo", step.adapters, scratch=step.scratch, native=step.native)
        assert step.mask is not None and step.write_index is not None  # an eager step has both
        qkv = qkv.view(b, t, h + 2 * kv, d)
        qk = apply_rope(qkv.narrow(2, 0, h + kv), step.cos, step.sin)  # [B, T, H + KV, D]
        # This step's K and V go to their positions first; then the slot range is read back as a plain slice.
        new_kv = torch.cat((qk.narrow(2, h, kv), qkv.narrow(2, h + kv, kv)), dim=2)  # [B, T, 2 * KV, D]
        kv_rows.index_copy_(0, step.write_index, finite_kv(new_kv).view(-1, d))
        length = step.mask.shape[-1]
        k = k_cache.narrow(2, 0, length)  # [B, KV, L, D]
        v = v_cache.narrow(2, 0, length)
        # GQA without repeating K/V: the G = H / KV query heads sharing a KV head become T*G query rows of it
        # (row t*G + g; a view when T = 1). On CPU this is several times faster than enable_gqa=True in bf16.
        q = qk.narrow(2, 0, h).view(b, t, kv, g * d).transpose(1, 2).reshape(b, kv, t * g, d)  # [B, KV, T*G, D]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask)  # [B, KV, T*G, D]
        y = y.view(b, kv, t, g * d).transpose(1, 2).reshape(b, t, h * d)  # [B, T, H*D], head = kv*G + g
        return proj(y, self.wo, self.bo, self.layer, "wo", step.adapters, scratch=step.scratch, native=step.native)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(gate(x)) * up(x)), with gate and up fused into one ``w13`` matmul."""

    def __init__(
        self, cfg: ModelConfig, layer: int, *, dtype: torch.dtype, device: torch.device, quantized: bool = False
    ) -> None:
        super().__init__()
        self.layer = layer
        i = cfg.intermediate_size
        self.w13: ProjWeight = _proj_weight(2 * i, cfg.hidden_size, quantized=quantized, dtype=dtype, device=device)
        self.w2: ProjWeight = _proj_weight(cfg.hidden_size, i, quantized=quantized, dtype=dtype, device=device)
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        if cfg.mlp_bias:
            self.b13 = _param(2 * i, dtype=dtype, device=device)
            self.b2 = _param(cfg.hidden_size, dtype=dtype, device=device)

    def forward(
        self,
        x: Tensor,
        adapters: AdapterHook | None,
        scratch: Scratch | None = None,
        native: NativeKernels | None = None,
    ) -> Tensor:
        gu = proj(x, self.w13, self.b13, self.layer, "w13", adapters, scratch=scratch, native=native)
        if native is not None:
            act = native.silu_mul(gu.contiguous())
        else:
            gate, up = gu.chunk(2, dim=-1)  # [B, T, I] each
            act = F.silu(gate).mul_(up)
        return proj(act, self.w2, self.b2, self.layer, "w2", adapters, scratch=scratch, native=native)


class Block(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, *, dtype: torch.dtype, device: torch.device, quantized: bool = False
    ) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attention_norm = RMSNorm(hidden, eps, "input_layernorm", dtype=dtype, device=device)
        self.attention = Attention(cfg, layer, dtype=dtype, device=device, quantized=quantized)
        self.ffn_norm = RMSNorm(hidden, eps, "post_attention_layernorm", dtype=dtype, device=device)
        self.feed_forward = FeedForward(cfg, layer, dtype=dtype, device=device, quantized=quantized)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device, quantized: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantized = quantized
        self.scratch = Scratch()
        self.tok_embeddings: Tensor | EmbeddingTable = _param(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=self.device
        )
        blocks = tuple(
            Block(cfg, i, dtype=dtype, device=self.device, quantized=quantized) for i in range(cfg.num_layers)
        )
        self.layers = nn.ModuleList(blocks)  # registers the parameters
        self.blocks: tuple[Block, ...] = blocks  # the same modules, typed
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "norm", dtype=dtype, device=self.device)
        if cfg.tie_word_embeddings:
            self.lm_head: Tensor | EmbeddingTable = self.tok_embeddings
        else:
            self.lm_head = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=self.device)
        self._inv_freq = rope_inv_freq(cfg)  # [D/2] fp32, CPU
        self._cos = torch.empty(0, cfg.head_dim, dtype=dtype, device=self.device)  # [P, D], grown on demand
        self._sin = self._cos
        self._draft_head: Tensor | None = None  # see draft_head()
        self.native = native_ops(dtype, self.device)  # compiled step ops (service.model.step) or None; and, dropped
        self.lora_native = self.native  # apart by the self-check, the LoRA tables' kernel (LoraTables)
        self.stack = DecodeStack(self)  # a decode step in one compiled call, where it applies

    def _rope_for(self, length: int) -> None:
        if self._cos.shape[0] < length:
            self._cos, self._sin = rope_table(self._inv_freq, length, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        slot_start: int,
        adapters: AdapterHook | None = None,
        *,
        kv_len: int | None = None,
        tree: Tensor | None = None,
    ) -> Tensor:
        """Run rows ``[slot_start, slot_start + B)`` of the cache; return final-normed hidden states [B, T, hidden].

        tokens, positions: [B, T] int64 on the model's device. ``kv_len`` bounds the keys attended to (must be
        ``> positions.max()``, or with ``tree`` the last cache position written); when ``None`` it is computed
        from ``positions`` (one device-to-host sync).

        ``tree`` [T, T] or [B, T, T] bool (see ``service.drafters.tree``; one tree for all rows, or one per row): the
        T tokens of a row are the nodes of a draft tree rooted at ``positions[:, 0]`` = L. Node i's K/V goes to cache
        position ``L + i`` while ``positions`` carries its RoPE position ``L + depth(i)``; it attends to the cache
        below L and to the nodes ``tree[i]`` marks.
        """
        b = tokens.shape[0]
        if positions.shape != tokens.shape:
            raise ValueError(f"positions {tuple(positions.shape)} must match tokens {tuple(tokens.shape)}")
        if slot_start < 0 or slot_start + b > cache.slots:
            raise ValueError(f"slots [{slot_start}, {slot_start + b}) are outside the cache's {cache.slots}")
        t = tokens.shape[1]
        if tree is None:
            slots_at = positions  # [B, T] cache position of each token's K/V
        else:
            if tuple(tree.shape) not in ((t, t), (b, t, t)):
                raise ValueError(f"tree mask {tuple(tree.shape)} must be [{t}, {t}] or [{b}, {t}, {t}]")
            slots_at = positions[:, :1] + torch.arange(t, device=tokens.device)[None, :]  # [B, T]: L + i
        length = int(slots_at.max()) + 1 if kv_len is None else kv_len
        if length > cache.max_len:
            raise ValueError(f"position {length - 1} is beyond the cache's max_len {cache.max_len}")
        self._rope_for(cache.max_len)
        native = self.native
        step = make_step((self._cos, self._sin), positions, slots_at, length, cache=cache, slot_start=slot_start,
                         heads_per_kv=self.cfg.num_heads // self.cfg.num_kv_heads, tree=tree, adapters=adapters,
                         scratch=self.scratch, native=native)  # fmt: skip

        emb = self.tok_embeddings
        x = F.embedding(tokens, emb) if isinstance(emb, Tensor) else emb.gather(tokens)  # [B, T, hidden]
        # The residual stream stays float32 in a reduced-precision model (as llama.cpp keeps activations in f32):
        # summing 60 sublayer outputs into a bf16 stream rounds away enough to flip near-tied tokens (SmolLM2's
        # answer to "What is the capital of France?"). Matmul inputs and the KV cache stay in the model dtype.
        x = x.float() if adapters is None else adapters.embed(x.float(), tokens)
        if (plan := self.stack.plan(step, adapters, b)) is not None:
            return self.stack.run(x, step, cache, slot_start, plan)
        y: Tensor | None = None  # the last sublayer's output, added to x by the next norm
        for i, layer in enumerate(self.blocks):
            k_cache, v_cache = cache.k[i].narrow(0, slot_start, b), cache.v[i].narrow(0, slot_start, b)
            x, h = add_normed(layer.attention_norm, x, y, i, adapters, native)
            y = layer.attention(h, step, cache.rows[i], k_cache, v_cache)
            x, h = add_normed(layer.ffn_norm, x, y, i, adapters, native)
            y = layer.feed_forward(h, adapters, self.scratch, native)
        return add_normed(self.norm, x, y, len(self.blocks), adapters, native)[1]

    @torch.inference_mode()
    def logits(self, hidden: Tensor, adapters: AdapterHook | None = None, rows: Sequence[int] | None = None) -> Tensor:
        """[N, ..., hidden] -> fp32 logits [N, ..., vocab]: the matmul in the model dtype, then, in a reduced
        precision, the ``EXACT_TOP`` largest of each row recomputed in float32 from the head's exact rows (bf16
        logits near 25 are rounded to steps of 1/8, which ties tokens that differ by less) unless the head gave
        exact float32 (the native Q8_0 kernel). With ``adapters``, state ``i`` is batch row ``rows[i]`` (None: row
        ``i``), grouped by head (``AdapterHook.head_parts``)."""
        parts = adapters.head_parts(rows, hidden.shape[0]) if adapters is not None else None
        if parts is None:
            return self._project(hidden, None)
        out = hidden.new_empty(*hidden.shape[:-1], self.cfg.vocab_size, dtype=torch.float32)
        for part in parts:
            out[part.index] = self._project(hidden.index_select(0, part.index), part)
        return out

    def _project(self, hidden: Tensor, part: HeadPart | None) -> Tensor:
        """``logits`` of ``hidden`` through one head part (its ``index`` unused here; None: the base head)."""
        head = self.lm_head if part is None or part.weight is None else part.weight
        raw = dense_head(hidden, head, self.native) if isinstance(head, Tensor) else head.project(hidden)
        logits, exact_already = raw.float(), raw.dtype == torch.float32  # float32 from a bf16 model: exact already
        delta = None
        if part is not None and part.a is not None and part.b is not None:
            delta = F.linear(F.linear(hidden.to(part.a.dtype), part.a), part.b).float()  # [..., vocab]
            logits += delta
        if exact_already:
            return logits
        top = logits.topk(EXACT_TOP, dim=-1).indices  # [..., k]
        flat = top.reshape(-1)
        rows = head[flat].float() if isinstance(head, Tensor) else head.rows(flat)  # [N * k, hidden] float32
        exact = torch.einsum("nh,nkh->nk", hidden.reshape(-1, hidden.shape[-1]).float(),
                             rows.view(-1, EXACT_TOP, hidden.shape[-1])).view(top.shape)  # fmt: skip
        if delta is not None:
            exact += delta.gather(-1, top)
        return logits.scatter_(-1, top, exact)

    def draft_head(self, rows: int) -> Tensor | EmbeddingTable:
        """The ``[vocab, hidden]`` projection Medusa heads draft ``rows`` states with: a compact head itself up to its
        ``draft_rows`` (its compiled kernel), else ``lm_head``, or a bf16 copy for an fp32 model where bf16 matmuls
        are fast (``platform.draft_dtype``: CUDA, CPUs with native bf16), made on first use. A draft only has to be
        likely: verification runs in the model's dtype, so output is unchanged. Projecting the heads' states reads
        the whole vocabulary matrix, a large part of a small model's step (figures: bench/README.md, Medusa)."""
        if not isinstance(self.lm_head, Tensor) and rows <= self.lm_head.draft_rows:
            return self.lm_head
        if self._draft_head is None:
            head = self.lm_head
            dense = head.detach() if isinstance(head, Tensor) else head.dequantize(self.dtype)
            self._draft_head = dense.to(draft_dtype(self.dtype, self.device))
        return self._draft_head

    @staticmethod
    def gather_last(hidden: Tensor, lengths: Tensor) -> Tensor:
        """hidden [B, T, hidden], lengths [B] -> hidden at each row's last real token, [B, hidden]."""
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden[rows, lengths - 1]

    def set_embeddings(self, table: Tensor | EmbeddingTable, head: Tensor | EmbeddingTable) -> None:
        """Replace the embedding and the output head by compact forms (a GGUF load, ``service.model.load_gguf``)."""
        for name in ("tok_embeddings", "lm_head"):
            self._parameters.pop(name, None)
        self.tok_embeddings = table
        self.lm_head = head
        self._draft_head = None

    def projection(self, layer: int, name: ProjName) -> ProjWeight:
        """The weight of projection ``name`` of ``layer`` (dense, quantized, or a placeholder not yet loaded)."""
        block = self.blocks[layer]
        return getattr(block.attention if name in ("wqkv", "wo") else block.feed_forward, name)  # type: ignore[no-any-return]

    def set_projection(self, layer: int, name: ProjName, weight: Weight) -> None:
        """Install the compact weight of a ``quantized`` model's projection (the loader, once per projection)."""
        if not self.quantized:
            raise ValueError("set_projection is for quantized models; a dense model's weights are loaded in place")
        expected = tuple(self.projection(layer, name).shape)
        if weight.shape != expected:
            raise ValueError(f"layer {layer} {name}: weight {weight.shape} where the model needs {expected}")
        block = self.blocks[layer]
        setattr(block.attention if name in ("wqkv", "wo") else block.feed_forward, name, weight)
        self.stack.invalidate()

    def compact_projections(self) -> Iterator[tuple[int, ProjName, Weight]]:
        """Every compact projection weight, layer by layer in ``PROJ_NAMES`` order (none in a dense model)."""
        if not self.quantized:
            return
        for layer in range(self.cfg.num_layers):
            for name in PROJ_NAMES:
                w = self.projection(layer, name)
                if not isinstance(w, Tensor):
                    yield layer, name, w

    @property
    def parameter_bytes(self) -> int:
        """Bytes of every weight as served: dense parameters, compact embedding / head, packed projections."""
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        compact = {id(w): w for w in (self.tok_embeddings, self.lm_head) if not isinstance(w, nn.Parameter)}
        dense += sum(w.nbytes for w in compact.values())  # a compact embedding / head (set_embeddings)
        return dense + sum(w.nbytes for _, _, w in self.compact_projections())
