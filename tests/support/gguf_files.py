"""Real GGUF files for tests: a tiny random Llama written the way llama.cpp's converter writes it.

``write_tiny_gguf`` takes an HF folder from ``tiny_models.write_tiny_llama`` and writes its weights with the
``gguf`` package's own writer and quantizers: Q/K rows permuted for llama.cpp's RoPE, each tensor in the ggml type
``types`` picks (first matching name fragment wins, else ``default``), the llama metadata from config.json, and a
few metadata pairs of every value type. ``reference_state`` is the model's weights as the GGUF holds them,
dequantized by ``gguf.dequantize`` and unpermuted in numpy: the float32 reference the loader must reproduce.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file

# Two tiny variants that cover every served type and the fallbacks: ``mixed`` (Q8_0 embedding and a Q8_0 part inside
# ``wqkv``, F16 ``wo``, Q4_0 ``w2``, BF16 untied head) and ``tied`` (MHA with biases, Q8_0 tied embedding/head, Q4_0
# and Q4_1 projections): (tiny Llama config overrides, ggml types by name fragment).
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "mixed": (
        {},
        {"token_embd": "Q8_0", "attn_v": "Q8_0", "attn_output": "F16", "ffn_down": "Q4_0", "output.": "BF16"},
    ),
    "tied": (
        {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
        {"token_embd": "Q8_0", "ffn_gate": "Q4_0"},
    ),
}


HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (rows of Q and K, per head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    folder: Path, path: Path, *, default: str = "Q4_1", types: dict[str, str] | None = None, version: int = 3
) -> Path:
    """Write ``folder``'s weights to the GGUF ``path`` (see the module docstring); return ``path``."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    _every_value_type(writer)
    for hf, w in weights.items():
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        name = gguf_name(hf)
        if ".attn_q." in name or ".attn_k." in name:
            heads = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
            w = llama_cpp_permute(w, heads)
        kind = default if w.ndim == 2 else "F32"
        kind = next((t for frag, t in (types or {}).items() if frag in name), kind)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "BF16":
            data = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16).view(torch.int16).numpy()
            writer.add_tensor(name, data.view(np.uint8).reshape(*w.shape[:-1], -1), raw_dtype=qtype)
        elif kind in ("F32", "F16"):
            writer.add_tensor(name, w.astype(np.float32 if kind == "F32" else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if version != 3:
        raw = bytearray(path.read_bytes())
        raw[4:8] = version.to_bytes(4, "little")
        path.write_bytes(bytes(raw))
    return path


def _every_value_type(writer: object) -> None:
    w = writer
    w.add_uint8("test.u8", 200)  # type: ignore[attr-defined]
    w.add_int8("test.i8", -100)  # type: ignore[attr-defined]
    w.add_uint16("test.u16", 60000)  # type: ignore[attr-defined]
    w.add_int16("test.i16", -30000)  # type: ignore[attr-defined]
    w.add_uint32("test.u32", 4_000_000_000)  # type: ignore[attr-defined]
    w.add_int32("test.i32", -2_000_000_000)  # type: ignore[attr-defined]
    w.add_float32("test.f32", 0.25)  # type: ignore[attr-defined]
    w.add_bool("test.bool", True)  # type: ignore[attr-defined]
    w.add_string("test.str", "héllo")  # type: ignore[attr-defined]
    w.add_uint64("test.u64", 1 << 60)  # type: ignore[attr-defined]
    w.add_int64("test.i64", -(1 << 60))  # type: ignore[attr-defined]
    w.add_float64("test.f64", 1e-300)  # type: ignore[attr-defined]
    w.add_array("test.arr_i32", [1, -2, 3])  # type: ignore[attr-defined]
    w.add_array("test.arr_str", ["a", "bc", ""])  # type: ignore[attr-defined]
    w.add_array("test.arr_nested", [[1, 2], [3]])  # type: ignore[attr-defined]


def reference_state(path: Path, cfg: dict[str, int]) -> dict[str, torch.Tensor]:
    """GGUF name -> the float32 weight the file holds, dequantized by ``gguf`` and with Q/K rows unpermuted."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(t.shape.tolist()[::-1])
        if ".attn_q." in t.name or ".attn_k." in t.name:
            w = _unpermute(w, cfg["num_attention_heads"] if ".attn_q." in t.name else cfg["num_key_value_heads"])
        out[t.name] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def write_reference_folder(src: Path, gguf_path: Path, dst: Path) -> Path:
    """An HF folder holding exactly the weights ``gguf_path`` stores (``reference_state``, back under HF names), with
    ``src``'s config and tokenizer files: what transformers / peft load as the float32 reference."""
    import shutil

    from safetensors.torch import save_file

    cfg = json.loads((src / "config.json").read_text())
    by_gguf = reference_state(gguf_path, cfg)
    hf_names = load_file(str(src / "model.safetensors")).keys()
    tensors = {hf: by_gguf[gguf_name(hf)] for hf in hf_names if gguf_name(hf) in by_gguf}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors"):
            shutil.copy(file, dst / file.name)
    return dst


def write_variant(variant: str, tiny_llama_factory: Callable[..., Path], tmp: Path) -> tuple[Path, Path]:
    """The HF folder of `VARIANTS` ``variant`` (from the ``tiny_llama_factory`` fixture) and its GGUF in ``tmp``."""
    config, types = VARIANTS[variant]
    folder = tiny_llama_factory(seed=21 + len(variant), **config)
    return folder, write_tiny_gguf(folder, tmp / "model.gguf", types=types)


def load_variant(variant: str, tiny_llama_factory: Callable[..., Path], tmp: Path, kernels: str = "auto") -> Any:
    """`VARIANTS` ``variant`` written to a GGUF in ``tmp`` and served from its blocks (float32, CPU): the ``Llama``;
    ``kernels``: ``--kernels`` (``auto``: the native kernels where they build, ``eager``: torch's)."""
    return _served(*write_variant(variant, tiny_llama_factory, tmp), kernels)


def variant_and_reference(
    variant: str, tiny_llama_factory: Callable[..., Path], tmp: Path, kernels: str = "auto"
) -> tuple[Any, Any]:
    """`load_variant` and transformers on the same file dequantized by ``gguf`` (the reference folder in ``tmp``)."""
    from support.tiny_models import load_hf_llama

    folder, gguf = write_variant(variant, tiny_llama_factory, tmp)
    return _served(folder, gguf, kernels), load_hf_llama(write_reference_folder(folder, gguf, tmp / "reference"))


def _served(folder: Path, gguf: Path, kernels: str) -> Any:
    from service.model.load_gguf import load_gguf_model
    from support.native import kernels_mode

    with kernels_mode(kernels):
        return load_gguf_model(folder, gguf, dtype=torch.float32)[0]
