"""A row's result does not depend on its batch or its KV slots, on every weight kind the model serves.

One check (``tiny_models.assert_row_independent``): a 9-token row's hidden states alone equal those it gets as one
row of a larger step written from some KV slot on, its neighbours random. Run on the dense float32 base, on the
int8 and int4 quantized bases and on both GGUF variants (``gguf_files.VARIANTS``), each on the tiny random Llama.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.gguf_files import VARIANTS, load_variant
from support.tiny_models import assert_row_independent, load_ours

pytestmark = pytest.mark.numerics

# Each case is (batch, row, first KV slot); the GGUF models get a smaller cache.
CASES = ((2, 1, 0), (5, 3, 2), (8, 0, 0))
KINDS = ["dense", "int8", "int4", *(f"gguf-{variant}" for variant in VARIANTS)]


def load_kind(kind: str, tiny_llama_factory: Callable[..., Path], tmp: Path) -> Any:
    """The tiny Llama as ``kind``: dense float32, quantized (int8 / int4) or one GGUF variant, on the CPU."""
    if kind == "dense":
        return load_ours(tiny_llama_factory())
    if kind in ("int8", "int4"):
        return load_ours(tiny_llama_factory(), quantize=kind)
    return load_variant(kind.removeprefix("gguf-"), tiny_llama_factory, tmp)


@pytest.mark.parametrize("kind", KINDS)
def test_row_result_independent_of_batch_and_slot(
    kind: str, tiny_llama_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = load_kind(kind, tiny_llama_factory, tmp_path)
    if kind.startswith("gguf-"):
        assert_row_independent(model, CASES[:2], cache_rows=8)
    else:
        assert_row_independent(model, CASES, cache_rows=10)
