"""From a Hugging Face checkpoint folder to a ready ``Llama``: the name map and the load.

The plan maps every Hugging Face tensor name to the exact memory it must land in: ``q_proj``/``k_proj``/``v_proj``
are row slices of the fused ``wqkv``, ``gate_proj``/``up_proj`` row slices of ``w13``, and so on, so the reader in
``service.loading`` streams each tensor straight into its final place (converting dtype on the way) and no
fused copy is ever made. The model is allocated with ``torch.empty`` directly on the target device: nothing is
initialised only to be overwritten. Missing, unexpected and mis-shaped tensors are the loader's typed errors,
naming the tensor and its file, raised before any tensor data is read.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
from torch import Tensor

from service.loading import CheckpointIndex, LoadMode, LoadStats, load_tensors
from service.metrics import MODEL_LOAD_BYTES, MODEL_LOAD_DURATION, MODEL_LOADED, MODEL_PARAMETER_BYTES
from service.model.config import ModelConfig
from service.model.llama import Llama

__all__ = ["build_load_plan", "load_model"]


def build_load_plan(model: Llama) -> tuple[dict[str, Tensor], list[str]]:
    """HF tensor name -> destination view in ``model``; plus names a checkpoint may hold that are not needed."""
    cfg = model.cfg
    fused = cfg.fused_rows()
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
        attn, ffn = block.attention, block.feed_forward
        for part in fused["wqkv"]:
            _add_projection(plan, f"{p}self_attn.{part.hf_name}", attn.wqkv, attn.bqkv, slice(part.start, part.stop))
        _add_projection(plan, f"{p}self_attn.o_proj", attn.wo, attn.bo)
        for part in fused["w13"]:
            _add_projection(plan, f"{p}mlp.{part.hf_name}", ffn.w13, ffn.b13, slice(part.start, part.stop))
        _add_projection(plan, f"{p}mlp.down_proj", ffn.w2, ffn.b2)
        plan[f"{p}input_layernorm.weight"] = block.attention_norm.weight.data
        plan[f"{p}post_attention_layernorm.weight"] = block.ffn_norm.weight.data
        ignore.append(f"{p}self_attn.rotary_emb.inv_freq")  # written by old transformers versions
    return plan, ignore


def _dense(weight: object) -> Tensor:
    """The memory of a dense weight; an HF folder loads into a freshly built model, whose weights are all dense."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"expected a dense tensor, got {type(weight).__name__}")
    return weight.data


def _add_projection(
    plan: dict[str, Tensor], name: str, weight: Tensor, bias: Tensor | None, rows: slice | None = None
) -> None:
    """``name.weight`` (and ``name.bias`` where the model has one) -> ``rows`` of ``weight`` / ``bias``, or all."""
    plan[f"{name}.weight"] = weight.data if rows is None else weight.data[rows]
    if bias is not None:
        plan[f"{name}.bias"] = bias.data if rows is None else bias.data[rows]


def load_model(
    folder: Path, *, dtype: torch.dtype, device: torch.device | str, mode: LoadMode = "stream"
) -> tuple[Llama, ModelConfig, LoadStats]:
    """Parse the config, read the headers, allocate the model on ``device`` and stream the weights into it.

    The returned stats count header parsing (``CheckpointIndex.open``) in ``header_seconds`` and this whole call
    (config, allocation, headers, reads) in ``total_seconds``. Records ``MODEL_LOAD_DURATION`` per stage,
    ``MODEL_LOAD_BYTES``, ``MODEL_PARAMETER_BYTES`` and sets ``MODEL_LOADED`` to 1.
    """
    t0 = time.perf_counter()
    folder = Path(folder)
    cfg = ModelConfig.from_hf(folder)
    index = CheckpointIndex.open(folder)
    model = Llama(cfg, dtype=dtype, device=torch.device(device))
    plan, ignore = build_load_plan(model)
    stats = load_tensors(index, plan, mode=mode, unexpected="error", ignore_unexpected=tuple(ignore))
    model.eval()
    # Headers were parsed by CheckpointIndex.open; count them, and make `total` this whole call.
    stats = dataclasses.replace(
        stats,
        header_seconds=stats.header_seconds + index.header_seconds,
        total_seconds=time.perf_counter() - t0,
    )
    for stage, seconds in (
        ("header", stats.header_seconds),
        ("read", stats.read_seconds),
        ("convert", stats.convert_seconds),
        ("total", stats.total_seconds),
    ):
        MODEL_LOAD_DURATION.labels(stage=stage, mode=mode).observe(seconds)
    MODEL_LOAD_BYTES.labels(mode=mode).inc(stats.bytes_read)
    MODEL_PARAMETER_BYTES.set(model.parameter_bytes)
    MODEL_LOADED.set(1)
    return model, cfg, stats
