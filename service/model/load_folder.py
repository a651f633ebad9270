"""From a Hugging Face checkpoint folder to a ready ``Llama``: the name map and the load.

The plan maps every Hugging Face tensor name to the exact memory it must land in: ``q_proj``/``k_proj``/``v_proj``
are row slices of the fused ``wqkv``, ``gate_proj``/``up_proj`` row slices of ``w13``, and so on, so the reader in
``service.loading`` streams each tensor straight into its final place (converting dtype on the way) and no
fused copy is ever made. The model is allocated with ``torch.empty`` directly on the target device: nothing is
initialised only to be overwritten. Missing, unexpected and mis-shaped tensors are the loader's typed errors,
naming the tensor and its file, raised before any tensor data is read.

With ``quantize`` (``"int8"`` / ``"int4"``) the whole plan is validated first, the dense tensors are streamed in
place, and then each fused projection in turn is streamed into one float32 staging buffer (the size of the largest
projection, reused) and quantized into the model: the dense projections are never all resident at once. A bf16
model on a CPU whose kernels have bf16 dot products loads its projections the same way into ``Bf16Pairs`` (the
checkpoint's values, kept in pairs for ``lp_pairs_matmul``; ``service.model.weights.bf16_pairs``), and its output
head (with a tied embedding) into a ``PairsTable``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from service.errors import TensorMismatch
from service.loading import CheckpointIndex, LoadMode, LoadStats, check_plan, load_tensors
from service.model.config import ModelConfig
from service.model.llama import PROJ_NAMES, Llama, ProjName
from service.model.step import native_ops
from service.model.weights.bf16_pairs import Bf16Pairs, PairsTable, pairs_wanted
from service.model.weights.kinds import QuantKind
from service.model.weights.kinds import quantize as kind_quantize
from service.model.weights.protocol import Weight

__all__ = ["build_load_plan", "load_model", "projection_parts"]

# HF module (under model.layers.{i}.) of each unfused projection.
_HF_MODULE: dict[ProjName, str] = {"wqkv": "self_attn", "wo": "self_attn", "w13": "mlp", "w2": "mlp"}
_HF_SINGLE: dict[ProjName, str] = {"wo": "o_proj", "w2": "down_proj"}


def projection_parts(cfg: ModelConfig, layer: int, name: ProjName) -> list[tuple[str, slice | None]]:
    """The HF module names (``model.layers.{layer}.self_attn.q_proj``, ...) that make up one projection, each with
    its rows in the fused weight (``None``: all of it)."""
    p = f"model.layers.{layer}.{_HF_MODULE[name]}."
    if name in _HF_SINGLE:
        return [(p + _HF_SINGLE[name], None)]
    return [(p + part.hf_name, slice(part.start, part.stop)) for part in cfg.fused_rows()[name]]


def build_load_plan(model: Llama) -> tuple[dict[str, Tensor], list[str]]:
    """HF tensor name -> destination view in ``model``; plus names a checkpoint may hold that are not needed."""
    cfg = model.cfg
    plan: dict[str, Tensor] = {
        "model.embed_tokens.weight": _dense(model.tok_embeddings),
        "model.norm.weight": model.norm.weight.data,
    }
    ignore = ["model.rotary_emb.inv_freq"]
    if cfg.tie_word_embeddings:
        ignore.append("lm_head.weight")  # some tied checkpoints still carry a copy; the embedding is the truth
    else:
        plan["lm_head.weight"] = _dense(model.lm_head)
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}."
        for name in PROJ_NAMES:
            module = block.attention if name in ("wqkv", "wo") else block.feed_forward
            weight = model.projection(i, name)
            if not isinstance(weight, Tensor):
                raise ValueError(f"layer {i} {name} is already quantized: a plan is built before loading")
            bias = getattr(module, {"wqkv": "bqkv", "wo": "bo", "w13": "b13", "w2": "b2"}[name])
            for hf, rows in projection_parts(cfg, i, name):
                _add_projection(plan, hf, weight, bias, rows)
        plan[f"{p}input_layernorm.weight"] = block.attention_norm.weight.data
        plan[f"{p}post_attention_layernorm.weight"] = block.ffn_norm.weight.data
        ignore.append(f"{p}self_attn.rotary_emb.inv_freq")  # written by old transformers versions
    return plan, ignore


def _dense(weight: object) -> Tensor:
    """The memory of a dense weight; an HF folder loads into a freshly built model, whose weights are all dense."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"expected a dense tensor, got {type(weight).__name__}")
    return weight.data


def _load_quantized(
    index: CheckpointIndex,
    model: Llama,
    plan: dict[str, Tensor],
    ignore: list[str],
    kind: QuantKind | None,
    group_size: int,
    mode: LoadMode,
    make: Callable[[Tensor], Weight],
) -> LoadStats:
    """Validate everything, load the dense tensors, then stream one projection at a time and ``make`` its compact
    form (``kind``'s quantizer, or ``Bf16Pairs.pack``)."""
    check_plan(index, plan, unexpected="error", ignore_unexpected=tuple(ignore))
    projections = [(i, name) for i in range(model.cfg.num_layers) for name in PROJ_NAMES]
    for i, name in projections:
        _check_quantizable(index, model, i, name, kind, group_size)
    stats = load_tensors(index, {n: t for n, t in plan.items() if t.device.type != "meta"}, mode=mode)
    largest = max(math.prod(model.projection(i, name).shape) for i, name in projections)
    staging = torch.empty(largest, dtype=torch.float32)  # [largest projection], reused by every projection
    for i, name in projections:
        rows, cols = model.projection(i, name).shape
        buf = staging[: rows * cols].view(rows, cols)  # [N, K]
        parts = projection_parts(model.cfg, i, name)
        part = load_tensors(index, {f"{hf}.weight": buf if r is None else buf[r] for hf, r in parts}, mode=mode)
        t0 = time.perf_counter()
        model.set_projection(i, name, make(buf.to(model.device)))
        stats = dataclasses.replace(
            stats,
            read_seconds=stats.read_seconds + part.read_seconds,
            convert_seconds=stats.convert_seconds + part.convert_seconds + time.perf_counter() - t0,
            bytes_read=stats.bytes_read + part.bytes_read,
            tensors=stats.tensors + part.tensors,
        )
    return stats


def _check_quantizable(
    index: CheckpointIndex, model: Llama, layer: int, name: ProjName, kind: QuantKind | None, group_size: int
) -> None:
    """Refuse, naming the tensor and its file, a projection the kernel cannot take (before any byte is read)."""
    if kind != "int4":
        return
    rows, cols = model.projection(layer, name).shape
    problem = None
    if cols % group_size:
        problem = f"{cols} input columns are not a multiple of the int4 group size {group_size}"
    elif rows % 16:
        problem = f"the fused {name} has {rows} rows, not a multiple of 16 (the int4 kernel's block)"
    if problem is not None:
        hf = f"{projection_parts(model.cfg, layer, name)[0][0]}.weight"
        raise TensorMismatch(f"cannot be quantized to int4: {problem}", file=index.tensors[hf].file, tensor=hf)


def _add_projection(
    plan: dict[str, Tensor], name: str, weight: Tensor, bias: Tensor | None, rows: slice | None = None
) -> None:
    """``name.weight`` (and ``name.bias`` where the model has one) -> ``rows`` of ``weight`` / ``bias``, or all."""
    plan[f"{name}.weight"] = weight.data if rows is None else weight.data[rows]
    if bias is not None:
        plan[f"{name}.bias"] = bias.data if rows is None else bias.data[rows]


def load_model(
    folder: Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    mode: LoadMode = "stream",
    quantize: QuantKind | None = None,
    group_size: int = 32,
    pairs: bool | None = None,
) -> tuple[Llama, ModelConfig, LoadStats]:
    """Parse the config, read the headers, allocate the model on ``device`` and stream the weights into it.

    ``quantize`` makes the four projections of every layer int8 or int4 (group-wise, ``group_size``) while
    streaming (see the module docstring). ``pairs``: a bf16 model's projections as ``Bf16Pairs`` (None: where
    ``pairs_wanted``; True: wherever the kernels are loaded, their portable code included; False: never). The
    returned stats count header parsing (``CheckpointIndex.open``) in ``header_seconds`` and this whole call (config,
    allocation, headers, reads) in ``total_seconds``; the caller records them (``service.bootstrap.record_load``).
    """
    t0 = time.perf_counter()
    folder = Path(folder)
    cfg = ModelConfig.from_hf(folder)
    index = CheckpointIndex.open(folder)
    native = native_ops(dtype, torch.device(device))
    want = pairs_wanted(dtype, torch.device(device), native) if pairs is None else pairs and dtype == torch.bfloat16
    packer = native if quantize is None and want else None
    model = Llama(cfg, dtype=dtype, device=torch.device(device), quantized=quantize is not None or packer is not None)
    plan, ignore = build_load_plan(model)
    if quantize is not None:
        kind = quantize
        stats = _load_quantized(index, model, plan, ignore, kind, group_size, mode,
                                lambda w: kind_quantize(w, kind, group_size, dtype=dtype))  # fmt: skip
    elif packer is not None:
        stats = _load_quantized(index, model, plan, ignore, None, group_size, mode, lambda w: Bf16Pairs.pack(w, packer))
        head = PairsTable(Bf16Pairs.pack(_dense(model.lm_head), packer))  # the tied embedding's rows gathered from it
        model.set_embeddings(head if cfg.tie_word_embeddings else _dense(model.tok_embeddings), head)
    else:
        stats = load_tensors(index, plan, mode=mode, unexpected="error", ignore_unexpected=tuple(ignore))
    model.eval()
    # Headers were parsed by CheckpointIndex.open; count them, and make `total` this whole call.
    stats = dataclasses.replace(
        stats,
        header_seconds=stats.header_seconds + index.header_seconds,
        total_seconds=time.perf_counter() - t0,
    )
    return model, cfg, stats
