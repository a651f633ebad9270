"""The trained demo heads (adapters/demo/medusa) on the real SmolLM2: valid, useful, and exact.

Greedy speculative decoding with the heads must produce exactly the plain greedy tokens over 20 held-out chat
prompts x 128 new tokens: in one batch that mixes rows with and without heads, and a few prompts alone. The heads
must also do better than chance on text they were not trained on (random heads accept ~nothing; the demo heads
accept roughly one draft in eight steps here: see scripts/train_medusa_heads.py for their held-out accuracy).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from support.paths import ROOT

from service.adapters.medusa import MedusaHeads, index_medusa
from service.model.load_folder import load_model
from service.tokenizer import Tokenizer
from tools.medusa import generate

DEMO = ROOT / "adapters" / "demo" / "medusa"


def _held_out_prompts() -> tuple[str, ...]:
    """The training script's held-out prompts (loaded from its file, as tests/proto/test_proto_generated.py does)."""
    spec = importlib.util.spec_from_file_location("train_medusa_heads", ROOT / "scripts" / "train_medusa_heads.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.HELD_OUT_PROMPTS)


PROMPTS = _held_out_prompts()

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> dict[str, Any]:
    model, cfg, _ = load_model(smollm2_dir, dtype=torch.float32, device="cpu")
    tok = Tokenizer.from_folder(smollm2_dir)
    spec = index_medusa(DEMO, cfg)
    heads = MedusaHeads.load(spec, device="cpu", dtype=torch.float32)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    return {"model": model, "cfg": cfg, "spec": spec, "heads": heads, "prompts": prompts}


def test_demo_heads_are_small_v2_heads(smol: dict[str, Any]) -> None:
    spec = smol["spec"]
    assert spec.version == 2 and 3 <= spec.num_heads <= 4 and spec.num_layers == 1
    assert sum(f.stat().st_size for f in spec.files) < 6 << 20
    assert spec.config.base_model_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_speculative_greedy_is_identical_and_accepts(smol: dict[str, Any]) -> None:
    model, heads, prompts = smol["model"], smol["heads"], smol["prompts"]
    eos = smol["cfg"].eos_token_ids
    plain = generate(model, prompts, 128, eos_token_ids=eos)
    mixed_heads = [heads if i % 4 else None for i in range(len(prompts))]
    spec = generate(model, prompts, 128, heads=mixed_heads, eos_token_ids=eos)
    assert spec.tokens == plain.tokens
    assert spec.stats.mean_accepted_length > 1.05, spec.stats
    alone = generate(model, [prompts[1]], 128, heads=heads, eos_token_ids=eos)
    assert alone.tokens == [plain.tokens[1]]
    assert alone.stats.accepted > 0, alone.stats
