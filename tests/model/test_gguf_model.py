"""A Llama served from GGUF blocks against transformers on the same weights dequantized by ``gguf`` (float32).

The reference folder (tests/support/gguf_files.py) is built from the file by the ``gguf`` package alone (its
dequantizer, numpy for llama.cpp's Q/K row order), so it shares no code with the loader under test. Two tiny
variants (``support.gguf_files.VARIANTS``) cover every served type and the fallbacks: ``mixed`` (Q8_0 embedding
and a Q8_0 part inside ``wqkv``, F16 ``wo``, Q4_0 ``w2``, BF16 untied head) and ``tied`` (MHA with biases, Q8_0 tied
embedding/head, Q4_0 and Q4_1 projections).
The tiny variants' prefill and greedy checks run with every weight kind's in test_dequantized_reference.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.gguf_files import VARIANTS, load_variant, write_reference_folder, write_tiny_gguf

from service import bootstrap
from service.kernels import native
from service.loading.gguf import read_gguf_header
from service.metrics import MODEL_LOAD_BYTES, MODEL_LOAD_DURATION
from service.model import Llama
from service.model.llama import PROJ_NAMES
from service.model.load_gguf import load_gguf_model
from service.model.weights import Int4Weight, Q8Table
from service.model.weights.q4_native import Q4Native

pytestmark = pytest.mark.numerics

INT4 = {"mixed": {"w13", "w2"}, "tied": set(PROJ_NAMES)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def served(
    request: pytest.FixtureRequest, tiny_llama_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Llama]:
    variant = request.param
    return variant, load_variant(variant, tiny_llama_factory, tmp_path_factory.mktemp(f"gguf_{variant}"))


def test_blocks_stay_packed_where_the_kernel_expresses_them(served: tuple[str, Llama]) -> None:
    variant, ours = served
    packed = Int4Weight if native.kernels() is None else Q4Native  # float32: the native kernel where it builds
    for i in range(ours.cfg.num_layers):
        for name in PROJ_NAMES:
            assert isinstance(ours.projection(i, name), packed) == (name in INT4[variant]), (i, name)
    assert isinstance(ours.tok_embeddings, Q8Table)
    if variant == "tied":
        assert ours.lm_head is ours.tok_embeddings
    else:
        assert isinstance(ours.lm_head, torch.Tensor) and ours.lm_head.dtype == torch.float32


def test_unpacked_load_is_the_reference_weights(tiny_llama_factory: Callable[..., Path], tmp_path: Path) -> None:
    """``packed=False`` dequantizes every block into float32: the same numbers gguf's dequantizer gives."""
    from support.tiny_models import load_ours

    folder = tiny_llama_factory(seed=21 + len("mixed"))
    gguf = write_tiny_gguf(folder, tmp_path / "m.gguf", types=VARIANTS["mixed"][1])
    dense = load_gguf_model(folder, gguf, dtype=torch.float32, packed=False)[0]
    reference = load_ours(write_reference_folder(folder, gguf, tmp_path / "ref"))
    for (name, got), (_, want) in zip(dense.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)


def test_load_metrics_cover_the_gguf_path(tiny_llama_dir: Path, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tiny_llama_dir, tmp_path / "m.gguf")
    total = MODEL_LOAD_DURATION.labels(stage="total", mode="gguf")
    seconds, nbytes = total._sum.get(), MODEL_LOAD_BYTES.labels(mode="gguf")._value.get()
    model, _, stats = load_gguf_model(tiny_llama_dir, gguf, dtype=torch.float32)
    bootstrap.record_load(stats, model)
    assert stats.mode == "gguf" and stats.tensors == 2 * 9 + 3
    assert total._sum.get() - seconds == pytest.approx(stats.total_seconds)
    assert MODEL_LOAD_BYTES.labels(mode="gguf")._value.get() - nbytes == stats.bytes_read
    data = read_gguf_header(gguf).tensors.values()
    assert stats.bytes_read == sum(t.nbytes for t in data)  # each data byte read once
