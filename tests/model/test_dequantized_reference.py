"""Every compact weight kind against transformers on its very weights dequantized to float32 (fp32, CPU).

The kinds: int8 and int4 quantized bases (``quant_reference.VARIANTS``: GQA, and MHA with biases and a tied head;
the reference written back by ``quant_reference.write_dequantized``) and GGUF blocks (``gguf_files.VARIANTS``; the
reference dequantized by the ``gguf`` package alone), on the native kernels and on torch's eager ones. Each kind:
prefill logits within ``ATOL`` of the reference, and greedy tokens identical on at least 90 % of the prompts (the
kernels accumulate in another order, nothing else differs). A new weight kind is one more entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import gguf_files, quant_reference
from support.tiny_models import greedy_agreement, max_prefill_logit_gap, random_prompts

pytestmark = pytest.mark.numerics

ATOL = 1e-4
QUANTIZED = [f"{kind}-{variant}" for kind in ("int8", "int4") for variant in quant_reference.VARIANTS]
# gguf: the native kernels where they build (service.kernels.native), gguf_eager: torch's, on the same files
GGUF = [f"{kind}-{variant}" for kind in ("gguf", "gguf_eager") for variant in gguf_files.VARIANTS]
PROMPT_SEED = {"int8": 5, "int4": 5, "gguf": 9, "gguf_eager": 9}  # each kind keeps the prompts it was first checked on


@pytest.fixture(scope="module", params=QUANTIZED + GGUF)
def pair(
    request: pytest.FixtureRequest, tiny_llama_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any, Any]:
    """(kind, our model, transformers on its dequantized weights) for one ``kind-variant``."""
    kind, variant = request.param.split("-", 1)
    tmp = tmp_path_factory.mktemp(f"dq_{request.param}")
    if kind.startswith("gguf"):
        kernels = "eager" if kind == "gguf_eager" else "auto"
        return kind, *gguf_files.variant_and_reference(variant, tiny_llama_factory, tmp, kernels)
    return kind, *quant_reference.quantized_and_reference(kind, variant, tiny_llama_factory, tmp)


def _prompts(kind: str, n: int) -> list[list[int]]:
    return random_prompts(n, seed=PROMPT_SEED[kind])


def test_prefill_logits_match_the_dequantized_reference(pair: tuple[str, Any, Any]) -> None:
    kind, ours, hf = pair
    assert max_prefill_logit_gap(ours, hf, _prompts(kind, 4)) < ATOL


def test_greedy_tokens_match_the_dequantized_reference(pair: tuple[str, Any, Any]) -> None:
    kind, ours, hf = pair
    prompts = _prompts(kind, 10)
    assert greedy_agreement(ours, hf, prompts, 24) >= 0.9 * len(prompts)
