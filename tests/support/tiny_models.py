"""Tiny random Llama checkpoints written by transformers itself, for tests that need real files but no download.

    write_tiny_llama(folder, *, seed=0, max_shard_size=None, legacy_rope_keys=False, **config_overrides) -> Path
    tiny_llama_config(**config_overrides) -> transformers.LlamaConfig
    load_hf_llama(folder) -> transformers.LlamaForCausalLM   (fp32, eval, the reference implementation)
    load_ours(folder, *, dtype=float32, quantize=None) -> service.model.Llama

The folder holds ``config.json``, ``generation_config.json`` and ``model.safetensors`` (or shards plus
``model.safetensors.index.json`` when ``max_shard_size`` is given, e.g. ``"200KB"``). Every parameter, norms and
biases included, is drawn from a seeded normal distribution with a spread large enough that logits are far from
uniform (so greedy decoding has no near-ties) and that a tensor loaded into the wrong place changes the output.
``legacy_rope_keys=True`` rewrites config.json in the pre-transformers-5 spelling (``rope_theta`` at the top,
``rope_scaling`` with ``type``) to exercise that parser.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def tiny_llama_config(**config_overrides: Any) -> Any:
    """A ``transformers.LlamaConfig`` with the tiny defaults above, overridden by keyword."""
    from transformers import LlamaConfig

    values = {**TINY_DEFAULTS, **config_overrides}
    return LlamaConfig(**values)


def write_tiny_llama(
    folder: Path,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    legacy_rope_keys: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write a random tiny ``LlamaForCausalLM`` to ``folder`` with ``save_pretrained``; return the folder."""
    from transformers import LlamaForCausalLM

    folder = Path(folder)
    config = tiny_llama_config(**config_overrides)
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name or name == "lm_head.weight":
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)  # unit-variance outputs per projection
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(folder, **kwargs)
    if legacy_rope_keys:
        _rewrite_legacy_rope(folder / "config.json")
    return folder


def write_served_tiny(folder: Path, tokenizer_from: Path, max_position_embeddings: int) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary and the tokenizer files found in ``tokenizer_from``."""
    import shutil

    write_tiny_llama(folder, vocab_size=49152, max_position_embeddings=max_position_embeddings, seed=7)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def load_hf_llama(folder: Path) -> Any:
    """The reference: transformers' own ``LlamaForCausalLM`` from ``folder``, fp32, eval mode, SDPA attention."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _rewrite_legacy_rope(config_path: Path) -> None:
    raw = json.loads(config_path.read_text())
    params = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    if rope_type != "default":
        raw["rope_scaling"] = {"type": rope_type, **params}
    config_path.write_text(json.dumps(raw, indent=2))


def load_ours(folder: Path, *, dtype: torch.dtype = torch.float32, quantize: str | None = None) -> Any:
    """``load_folder.load_model`` on the CPU (``quantize``: None, "int8" or "int4"); returns the ``Llama``."""
    from service.model.load_folder import load_model

    return load_model(folder, dtype=dtype, device="cpu", quantize=quantize)[0]  # type: ignore[arg-type]


def greedy_generate(
    model: Any, prompt: list[int], max_new_tokens: int, *, eos_token_ids: tuple[int, ...] = ()
) -> list[int]:
    """Greedy decoding with ``service.model`` alone: prefill into slot 0, then one token per step through the cache.

    Stops after ``max_new_tokens`` or right after an end-of-sequence token (which is returned, as transformers
    ``generate`` does). Returns the new tokens only.
    """
    from service.model import KVCache

    cache = KVCache(model.cfg, 1, len(prompt) + max_new_tokens, dtype=model.dtype, device=model.device)
    tokens = torch.tensor([prompt], device=model.device)  # [1, P]
    positions = torch.arange(len(prompt), device=model.device)[None, :]  # [1, P]
    hidden = model(tokens, positions, cache, 0)[:, -1]  # [1, hidden]
    out: list[int] = []
    for step in range(max_new_tokens):
        token = int(model.logits(hidden).argmax(-1))
        out.append(token)
        if token in eos_token_ids or step == max_new_tokens - 1:
            break
        position = torch.tensor([[len(prompt) + step]], device=model.device)
        hidden = model(torch.tensor([[token]], device=model.device), position, cache, 0)[:, -1]
    return out


def random_prompts(n: int, seed: int, vocab: int = 256) -> list[list[int]]:
    """``n`` seeded prompts of 4 to 19 token ids in [3, vocab)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (int(torch.randint(4, 20, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


def max_prefill_logit_gap(ours: Any, hf: Any, prompts: list[list[int]]) -> float:
    """Largest |ours - transformers| over the prefill logits of each prompt (float32, slot 0 of a fresh cache)."""
    from service.model import KVCache

    gap = 0.0
    for ids in prompts:
        t = torch.tensor([ids])  # [1, P]
        cache = KVCache(ours.cfg, 1, len(ids), dtype=torch.float32, device=ours.device)
        got = ours.logits(ours(t, torch.arange(len(ids))[None, :], cache, 0))  # [1, P, vocab]
        with torch.no_grad():
            ref = hf(t).logits
        gap = max(gap, float((got - ref).abs().max()))
    return gap


def greedy_agreement(ours: Any, hf: Any, prompts: list[list[int]], new_tokens: int) -> int:
    """How many prompts ``greedy_generate`` continues exactly as transformers' greedy ``generate`` does."""
    same = 0
    for ids in prompts:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
        same += greedy_generate(ours, ids, new_tokens) == ref[0, len(ids) :].tolist()
    return same


def assert_row_independent(model: Any, cases: tuple[tuple[int, int, int], ...], cache_rows: int) -> None:
    """A 9-token row's hidden states alone equal those it gets as row ``row`` of a ``batch``-row step written
    from KV slot ``slot_start`` on (each case ``(batch, row, slot_start)``), its neighbours random."""
    from service.model import KVCache

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 256, (9,), generator=gen)
    solo_cache = KVCache(model.cfg, 1, 32, dtype=torch.float32, device=model.device)
    solo = model(ids[None, :], torch.arange(9)[None, :], solo_cache, 0)[0]  # [9, hidden]
    for batch, row, slot_start in cases:
        tokens = torch.randint(3, 256, (batch, 9), generator=gen)
        tokens[row] = ids
        cache = KVCache(model.cfg, cache_rows, 32, dtype=torch.float32, device=model.device)
        got = model(tokens, torch.arange(9).expand(batch, 9), cache, slot_start)[row]
        torch.testing.assert_close(got, solo, rtol=1e-5, atol=1e-5)
