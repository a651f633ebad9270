"""The models and LoRA layers the one-call step's tests run (tests/model/test_decode_stack.py, test_draft_passes.py):
a tiny Llama on 4-bit weights, random LoRA layers on any of its projections, and the compiled LoRA tables."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from service.adapters.lora.batch import LoraTables
from service.adapters.lora.types import LoraLayer, LoraModule
from service.model import Llama
from service.model.load_gguf import load_gguf_model
from support.gguf_files import write_tiny_gguf
from support.native import compiled_kernels, kernels_mode

CPU = torch.device("cpu")
SHAPES = {  # module -> (in, out) as functions of the config
    "q_proj": lambda c: (c.hidden_size, c.num_heads * c.head_dim),
    "k_proj": lambda c: (c.hidden_size, c.num_kv_heads * c.head_dim),
    "v_proj": lambda c: (c.hidden_size, c.num_kv_heads * c.head_dim),
    "o_proj": lambda c: (c.num_heads * c.head_dim, c.hidden_size),
    "gate_proj": lambda c: (c.hidden_size, c.intermediate_size),
    "up_proj": lambda c: (c.hidden_size, c.intermediate_size),
    "down_proj": lambda c: (c.intermediate_size, c.hidden_size),
}


def load_q4(folder: Path, gguf: Path) -> Llama:
    """A GGUF's model on the compiled kernels, float32."""
    compiled_kernels()
    with kernels_mode("auto"):
        model: Llama = load_gguf_model(folder, gguf, dtype=torch.float32)[0]
    return model


def tiny_q4_model(tiny_llama_factory: Callable[..., Path], tmp: Path) -> Llama:
    """A tiny Llama whose projections are all 4-bit (Q4_1, the down projection Q4_0) and embedding Q8_0."""
    folder = tiny_llama_factory(seed=5)
    gguf = write_tiny_gguf(folder, tmp / "q4.gguf", types={"token_embd": "Q8_0", "ffn_down": "Q4_0"})
    return load_q4(folder, gguf)


def lora_layer(cfg: Any, seed: int, modules: tuple[str, ...] = tuple(SHAPES)) -> LoraLayer:
    """A random LoRA layer on ``modules``, ranks 4 and 8 in turn; the first module a DoRA rescale and a bias."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, name in enumerate(modules):
        k, n = SHAPES[name](cfg)
        r = 4 + 4 * (i % 2)
        a, b = torch.randn(r, k, generator=g) / k**0.5, torch.randn(n, r, generator=g) * 0.2
        rescale, bias = (
            (torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g) * 0.1) if i == 0 else (None, None)
        )
        out[name] = LoraModule(a=a, b=b, rescale=rescale, bias=bias)
    return LoraLayer(modules=out, nbytes=0)


def lora_tables(model: Llama) -> LoraTables:
    """Fresh LoRA tables of ``model``, compiled where its kernels are."""
    return LoraTables(model.cfg, device=CPU, dtype=model.dtype, native=model.lora_native)
