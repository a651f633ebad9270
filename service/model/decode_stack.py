"""A whole decode step in one compiled call (``lp_decode_stack``): a float32 model on 4-bit or dense weights, a
bfloat16 model on dense weights or weights in pairs.

    DecodeStack(model)                      built once per model; ``invalidate()`` after a projection changes
    stack.plan(step, adapters, rows)        how this pass runs as one call (``Plan``), or None: the per-op path
    stack.run(x, step, cache, slot_start, plan)   x [B, 1, hidden] embedded -> final-normed hidden [B, 1, hidden]
    compare(model) -> (stack, per-op) | None   two decode steps both ways (the self-check's probe)

The per-op path of ``Llama.forward`` with the compiled step ops runs about eight compiled calls a layer from Python
(``service/kernels/src/decode.cpp`` lists them); at one token a row the interpreter between them costs as much as the
attention and the norms together (bench/README.md, "A decode step in one call"). ``lp_decode_stack`` runs the same
entry points in the same order on the same values, so its hidden states are bit-identical to that path's
(``tests/model/test_decode_stack.py``), and the start-up self-check compares the two on the served model before
trusting it (``compare``; a mismatch drops to the per-op path).

It takes a pass when: the model is float32 or bfloat16 on the CPU with the step ops loaded (``Llama.native``), every
projection is a ``Q4Native`` (a GGUF's Q4_0 / Q4_1 blocks; float32 only), a ``Bf16Pairs`` (bfloat16 only) or a dense
weight of the model's dtype, without a bias, the pass is a decode step (one token a row: ``Step.pos``), a causal
chain (T tokens a row at consecutive positions, each seeing those before it: a prefill, or a draft chain's
verification) or a draft tree's verification (``Step.tree``: each node seeing the cache below its root and its
ancestors), each token run as the decode step after the tokens it sees would run it, so speculation's output is
plain decoding's bit for bit, the rows of its products (B, or T B) are below every projection's
``dense_from_rows`` (a Q4Native's: from there a dense matmul is faster; a Bf16Pairs's is never reached) or within
``native_dense_rows`` (a dense weight's: from there torch's GEMM; the per-op path takes both), and the rows'
adapters, if any, change only projections, through the compiled LoRA tables (``AdapterHook.stack_lora``: LoRA,
DoRA, mixtures; the embedding and the head are handled outside as always; a replaced norm weight is not).
Everything else, and a model whose table could not be built, is the per-op path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from service.kernels.lora import StackLora
from service.kernels.native import NativeKernels
from service.model.config import ModelConfig
from service.model.hooks import PROJ_NAMES, AdapterHook
from service.model.kv_cache import KVCache
from service.model.step import Step
from service.model.weights.bf16_pairs import Bf16Pairs
from service.model.weights.protocol import native_dense_rows
from service.model.weights.q4_native import Q4Native

__all__ = ["DecodeStack", "Plan", "compare"]

PAIRS_FIELD = 1  # a projection's third field when its weight is a Bf16Pairs (decode.cpp's kPairs)


class Model(Protocol):
    """What the stack reads of ``service.model.llama.Llama`` (which holds one: no import back)."""

    cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device
    native: NativeKernels | None
    blocks: tuple[Any, ...]  # Block: attention_norm, attention, ffn_norm, feed_forward
    norm: Any  # RMSNorm
    stack: DecodeStack

    def forward(
        self, tokens: Tensor, positions: Tensor, cache: KVCache, slot_start: int, *a: Any, **k: Any
    ) -> Tensor: ...


@dataclass(frozen=True)
class Plan:
    """A pass ``DecodeStack.plan`` runs as one call: with the rows' compiled LoRA tables, or none."""

    lora: StackLora | None


class DecodeStack:
    """The table of a model's weights for ``lp_decode_stack``, built on first use; ``enabled`` False: never taken."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.enabled = True
        self._table: ctypes.Array[ctypes.c_int64] | None = None
        self._max_rows = 0  # rows from which some projection leaves its kernel; 0: the model cannot take the stack
        self._built = False
        self.calls = 0  # passes run as one call (the self-check and the tests see that it took them)

    def invalidate(self) -> None:
        """Forget the table (a projection was replaced: loading, dense copies, the self-check's probes)."""
        self._table, self._max_rows, self._built = None, 0, False

    def plan(self, step: Step, adapters: AdapterHook | None, rows: int) -> Plan | None:
        """How this pass runs as one call, or None: the per-op path (see the module docstring)."""
        if not self.enabled or step.pos is None or step.native is None:
            return None
        if not self._built:
            self._build()
        if rows * step.cos.shape[1] >= self._max_rows:
            return None
        if adapters is None:
            return Plan(None)
        lora = adapters.stack_lora()
        return None if lora is None else Plan(lora)

    def _build(self) -> None:
        self._built = True
        model = self.model
        dtype, native = model.dtype, model.native
        if native is None or native_dense_rows(dtype, native) == 0 or model.device.type != "cpu":
            return
        fields: list[int] = []
        max_rows = None
        for layer in model.blocks:
            attn, ffn = layer.attention, layer.feed_forward
            if any(bias is not None for bias in (attn.bqkv, attn.bo, ffn.b13, ffn.b2)):
                return
            norms = (layer.attention_norm.weight, layer.ffn_norm.weight)
            if any(w.dtype != dtype or not w.is_contiguous() for w in norms):
                return
            fields += [w.data_ptr() for w in norms]
            for name in PROJ_NAMES:
                w = getattr(attn if name in ("wqkv", "wo") else ffn, name)
                if isinstance(w, Q4Native) and dtype == torch.float32 and w.device.type == "cpu":
                    fields += [w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr()]
                    rows = w.dense_from_rows
                elif isinstance(w, Bf16Pairs) and dtype == torch.bfloat16 and w.device.type == "cpu":
                    fields += [w.packed.data_ptr(), 0, PAIRS_FIELD]
                    rows = w.dense_from_rows
                elif isinstance(w, Tensor) and w.dtype == dtype and w.is_contiguous() and w.device.type == "cpu":
                    fields += [w.data_ptr(), 0, 0]  # a dense weight: protocol.linear's kernel up to its rows
                    rows = native_dense_rows(dtype, native) + 1
                else:
                    return
                max_rows = rows if max_rows is None else min(max_rows, rows)
        if max_rows is None or len(fields) != len(model.blocks) * native.decode_fields:
            return
        self._table = (ctypes.c_int64 * len(fields))(*fields)
        self._max_rows = max_rows

    def run(self, x: Tensor, step: Step, cache: KVCache, slot_start: int, plan: Plan) -> Tensor:
        """One decode step as ``plan`` says: x [B, T, hidden] float32, the embedded tokens (adapters' embeddings
        applied; T = 1, or a chain's T) -> the final-normed hidden states [B, T, hidden]; writes each row's K/V into
        its slot of ``cache``."""
        model, native, table, pos = self.model, step.native, self._table, step.pos
        assert native is not None and table is not None and pos is not None
        cfg, b, t = model.cfg, x.shape[0], x.shape[1]

        def token_major(v: Tensor, width: int) -> Tensor:  # [B, T, ...] -> [T B, width]
            return v.reshape(b, t, width).transpose(0, 1).reshape(t * b, width).contiguous()

        x = token_major(x, cfg.hidden_size)  # the residual stream, updated in place
        cos, sin, kv = token_major(step.cos, cfg.head_dim), token_major(step.sin, cfg.head_dim), cache.data
        for v, dtype in ((x, torch.float32), (cos, model.dtype), (sin, model.dtype), (kv, model.dtype)):
            if v.dtype != dtype or not v.is_contiguous() or v.device.type != "cpu":
                raise ValueError(f"the decode stack takes contiguous {dtype} CPU tensors here, got {v.dtype} {v.shape}")
        if kv.shape[0] != len(model.blocks) or not 0 <= slot_start <= kv.shape[2] - b or kv.shape[5] != cfg.head_dim:
            raise ValueError(f"the decode stack: slots [{slot_start}, {slot_start + b}) of a cache {tuple(kv.shape)}")
        if pos.shape != (t * b,) or pos.dtype != torch.int64 or not pos.is_contiguous():
            raise ValueError(f"the decode stack: positions {pos.dtype} {tuple(pos.shape)} for {b} rows")
        dims = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)
        self.calls += 1
        if plan.lora is not None and not 0 <= plan.lora.span[0] <= plan.lora.span[1] <= b:
            raise ValueError(f"the decode stack: LoRA rows {plan.lora.span} of a batch of {b}")
        rope = (cos, sin, pos)
        out = native.decode_stack(x, table, dims, model.norm.weight, cfg.rms_norm_eps, rope, kv, slot_start, plan.lora,
                                  tokens=t, tree=step.tree)  # fmt: skip
        return out.view(t, b, cfg.hidden_size).transpose(0, 1).contiguous()


def compare(model: Model) -> tuple[Tensor, Tensor] | None:
    """The hidden states of two decode steps of two rows through the stack and through the per-op path it replaces
    (equal bit for bit when the stack is right), on a scratch cache; None when the stack does not take the model."""
    stack = model.stack
    cache = KVCache(model.cfg, 2, 4, dtype=model.dtype, device=model.device)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 1), generator=torch.Generator().manual_seed(0))
    outs, calls = [], stack.calls
    try:
        for enabled in (True, False):
            stack.enabled = enabled
            cache.data.zero_()
            outs.append(
                torch.cat([model.forward(tokens, torch.full((2, 1), p), cache, 0, kv_len=p + 1) for p in (0, 1)])
            )
    finally:
        stack.enabled = True
    return (outs[0], outs[1]) if stack.calls == calls + 2 else None
