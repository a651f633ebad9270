"""From a llama.cpp GGUF file to our fused layout: the name map and the checks, before any tensor data is read.

Every destination of the model (``wqkv`` and ``w13`` of each layer fused by rows, ``wo``, ``w2``, the norms, the
embedding and an untied head) is a :class:`Target` listing the GGUF tensors that fill it and the rows each fills.
``blk.N.attn_q`` / ``attn_k`` are stored by llama.cpp with each head's rows interleaved for its RoPE convention
(``convert_hf_to_gguf.py``'s ``permute``); ``Part.heads`` says how many heads to undo that over, and
:func:`unpermute_rows` gives the destination row of each file row (rows move whole, so quantized blocks, which
lie within a row, are unchanged).

:func:`check_gguf` compares the file with the model config (architecture, layer count, widths, head counts,
vocabulary, RoPE base, norm epsilon) and every tensor with its target (missing, unexpected, mis-shaped, a type
that cannot be served), and raises one typed error naming the file and every offending tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from service.errors import GGUFUnsupported, TensorMismatch
from service.loading.gguf import GGUFHeader
from service.loading.gguf_blocks import SUPPORTED
from service.model.config import ModelConfig

__all__ = ["Part", "Target", "check_gguf", "gguf_targets", "unpermute_rows"]

_IGNORED = ("rope_freqs.weight",)  # llama3 frequency factors: we compute RoPE from config.json


@dataclass(frozen=True)
class Part:
    """GGUF tensor ``name`` fills rows ``[start, stop)`` of its target; ``heads``: undo the Q/K row permutation."""

    name: str
    start: int
    stop: int
    heads: int | None = None


@dataclass(frozen=True)
class Target:
    """One destination: ``layer`` (None for the embedding, final norm and head), ``attr`` the model attribute
    (``wqkv``, ``attention_norm``, ``tok_embeddings`` ...), ``shape`` its full shape, ``parts`` what fills it."""

    layer: int | None
    attr: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]

    @property
    def is_projection(self) -> bool:
        return self.attr in ("wqkv", "wo", "w13", "w2")


def unpermute_rows(rows: int, heads: int) -> Tensor:
    """[rows] int64: the HF row that each llama.cpp row of a Q or K weight (or bias) belongs to.

    llama.cpp stores HF row ``h*D + s*D/2 + j`` (head h, half s, index j) at row ``h*D + 2j + s``."""
    d = rows // heads
    return torch.arange(rows).view(heads, 2, d // 2).transpose(1, 2).reshape(rows)


_Row = tuple[str, int, int, int | None]  # GGUF name stem, first and last row, heads to unpermute


def gguf_targets(cfg: ModelConfig) -> list[Target]:
    """Every destination of a Llama with ``cfg`` and the GGUF tensors (weights and biases) that fill it."""
    h, kv, d, hid, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    q_rows, kv_rows = h * d, kv * d
    targets = [
        Target(None, "tok_embeddings", (cfg.vocab_size, hid), (Part("token_embd.weight", 0, cfg.vocab_size),)),
        Target(None, "norm", (hid,), (Part("output_norm.weight", 0, 1),)),
    ]
    if not cfg.tie_word_embeddings:
        targets.append(Target(None, "lm_head", (cfg.vocab_size, hid), (Part("output.weight", 0, cfg.vocab_size),)))
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        qkv: tuple[_Row, ...] = (
            (b + "attn_q", 0, q_rows, h),
            (b + "attn_k", q_rows, q_rows + kv_rows, kv),
            (b + "attn_v", q_rows + kv_rows, q_rows + 2 * kv_rows, None),
        )
        w13: tuple[_Row, ...] = ((b + "ffn_gate", 0, inter, None), (b + "ffn_up", inter, 2 * inter, None))
        fused: list[tuple[str, int, tuple[_Row, ...], bool]] = [
            ("wqkv", hid, qkv, cfg.attention_bias),
            ("wo", q_rows, ((b + "attn_output", 0, hid, None),), cfg.attention_bias),
            ("w13", hid, w13, cfg.mlp_bias),
            ("w2", inter, ((b + "ffn_down", 0, hid, None),), cfg.mlp_bias),
        ]
        for attr, cols, parts, bias in fused:
            rows = parts[-1][2]
            targets.append(Target(i, attr, (rows, cols), tuple(Part(f"{n}.weight", s, e, p) for n, s, e, p in parts)))
            if bias:
                bias_attr = {"wqkv": "bqkv", "wo": "bo", "w13": "b13", "w2": "b2"}[attr]
                targets.append(Target(i, bias_attr, (rows,), tuple(Part(f"{n}.bias", s, e, p) for n, s, e, p in parts)))
        targets.append(Target(i, "attention_norm", (hid,), (Part(b + "attn_norm.weight", 0, 1),)))
        targets.append(Target(i, "ffn_norm", (hid,), (Part(b + "ffn_norm.weight", 0, 1),)))
    return targets


def part_shape(target: Target, part: Part) -> tuple[int, ...]:
    """The shape the file's tensor must have to fill ``part`` of ``target``."""
    if len(target.shape) == 1:
        return (target.shape[0],) if part.stop == 1 and len(target.parts) == 1 else (part.stop - part.start,)
    return (part.stop - part.start, target.shape[1])


def _config_problems(header: GGUFHeader, cfg: ModelConfig) -> list[str]:
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFUnsupported(f"general.architecture is {arch!r}; this server serves 'llama' GGUFs", file=header.file)
    expected: dict[str, Any] = {
        "llama.block_count": cfg.num_layers,
        "llama.embedding_length": cfg.hidden_size,
        "llama.feed_forward_length": cfg.intermediate_size,
        "llama.attention.head_count": cfg.num_heads,
        "llama.attention.head_count_kv": cfg.num_kv_heads,
        "llama.rope.freq_base": cfg.rope_theta,
        "llama.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
    }
    problems = []
    for key, want in expected.items():
        got = meta.get(key)
        if got is None and key.endswith("head_count_kv"):
            got = meta.get("llama.attention.head_count")  # absent = no GQA
        close = isinstance(got, (int, float)) and abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))
        if got is not None and not close:
            problems.append(f"{key}={got!r} but config.json says {want!r}")
    return problems


def check_gguf(header: GGUFHeader, cfg: ModelConfig, targets: list[Target]) -> None:
    """Raise ``TensorMismatch`` (or ``GGUFUnsupported``) naming every way ``header`` cannot fill ``targets``."""
    problems = _config_problems(header, cfg)
    planned: set[str] = set()
    bad: list[str] = []
    unsupported: list[str] = []
    for target in targets:
        for part in target.parts:
            planned.add(part.name)
            t = header.tensors.get(part.name)
            if t is None:
                bad.append(f"{part.name}: missing")
            elif t.shape != part_shape(target, part):
                bad.append(f"{part.name}: shape {list(t.shape)}, the config needs {list(part_shape(target, part))}")
            elif t.ggml_type.name not in SUPPORTED:
                unsupported.append(f"{part.name}: {t.ggml_type.name}")
    unexpected = sorted(set(header.tensors) - planned - set(_IGNORED))
    bad += [f"{name}: unexpected" for name in unexpected]
    if problems or bad:
        first = bad[0].split(":")[0] if bad else None
        raise TensorMismatch("; ".join(problems + bad), file=header.file, tensor=first)
    if unsupported:
        served = ", ".join(sorted(SUPPORTED))
        raise GGUFUnsupported(
            f"ggml types not served (only {served}): {'; '.join(unsupported)}",
            file=header.file,
            tensor=unsupported[0].split(":")[0],
        )
