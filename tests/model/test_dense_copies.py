"""Dense copies of a quantized base (``--dense-copies-mb``) and the compact head's batched projection.

A copy is the weight's own dequantized values: with it, a large batch multiplies exactly what the scratch path
would have dequantized, a small one still runs the kernel, and the budget bounds what is kept. The Q8_0 head
projects several hidden states through dense matmuls (chunks of dequantized vocabulary rows, or its kept copy),
the same values as the dense head of the dequantized model. Served end to end, a GGUF base with all copies kept
gives the transformers reference's greedy tokens, as without them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from loraplex import Client
from support.adapter_files import reference_greedy
from support.gguf_files import write_reference_folder, write_tiny_gguf
from support.tiny_models import load_hf_llama

from service.config import ConfigError, Settings
from service.model.llama import PROJ_NAMES
from service.model.load_gguf import load_gguf_model
from service.model.weights import NEVER, Q8Table, dense_from_rows, linear, q8_table, quantize, with_dense_copy
from service.model.weights.dense_copies import keep_dense_copies
from service.tokenizer import Tokenizer

pytestmark = pytest.mark.numerics

PROMPTS = [f"Write a short story about a robot number {i}." for i in range(4)]


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dense_copy_serves_large_batches_and_leaves_small_ones_to_the_kernel(kind: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    w = quantize(torch.randn(96, 128, generator=gen), kind, dtype=dtype)  # type: ignore[arg-type]
    copy = with_dense_copy(w)
    assert torch.equal(copy.dense, w.dequantize())  # type: ignore[arg-type]
    assert copy.nbytes == w.nbytes + 96 * 128 * dtype.itemsize
    assert with_dense_copy(copy) is copy
    rows = dense_from_rows(kind, dtype, copy=True)  # type: ignore[arg-type]
    if rows == NEVER:  # this CPU's kernel beats a dense matmul at every batch size: the copy only waits
        many = torch.randn(256, 128, generator=gen).to(dtype)
        assert torch.equal(linear(many, copy), linear(many, w))
        return
    large = torch.randn(max(rows, 2), 128, generator=gen).to(dtype)
    assert torch.equal(linear(large, copy), F.linear(large, w.dequantize()))
    if rows > 1:
        small = large[: rows - 1]
        assert torch.equal(linear(small, copy), linear(small, w))  # the kernel, as without a copy


@pytest.fixture(scope="module")
def tiny_gguf(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("dense_copies")
    types = {"token_embd": "Q8_0", "output.": "Q8_0"}  # an untied head, in Q8_0 blocks too
    gguf = write_tiny_gguf(served_tiny_dir, tmp / "served.gguf", types=types)
    return {"gguf": gguf, "reference": write_reference_folder(served_tiny_dir, gguf, tmp / "reference")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_q8_head_projects_a_batch_as_its_dequantized_table(
    served_tiny_dir: Path, tiny_gguf: dict[str, Path], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    model = load_gguf_model(served_tiny_dir, tiny_gguf["gguf"], dtype=dtype)[0]
    head = model.lm_head
    assert isinstance(head, Q8Table)
    monkeypatch.setattr(q8_table, "HEAD_CHUNK_ROWS", 1000)  # several chunks, the last one short
    rows = max(q8_table.PAIR_MAX_ROWS, q8_table.NATIVE_MAX_ROWS[dtype]) + 1  # past the kernels': chunked / dense
    hidden = torch.randn(rows, model.cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(dtype)
    dense = head.dequantize(dtype)
    want = F.linear(hidden, dense)
    chunked = head.project(hidden)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(chunked, want, atol=tol, rtol=tol)
    one = head.project(hidden[:1])  # one state: the per-group kernel (float32, exact) or the int4 pair (bf16)
    if dtype == torch.float32:
        torch.testing.assert_close(one, F.linear(hidden[:1], dense), atol=tol, rtol=tol)
    size = head.keep_dense()
    assert size == dense.numel() * dtype.itemsize and head.keep_dense() == 0
    assert torch.equal(head.dense, dense)  # type: ignore[arg-type]
    assert torch.equal(head.project(hidden), want)
    assert torch.equal(head.project(hidden[:1]), one)


def test_the_bf16_head_int4_pair_holds_the_tables_values(served_tiny_dir: Path, tiny_gguf: dict[str, Path]) -> None:
    """lo with scale d and zero 8d plus hi + 8 with scale 16d: through the kernel itself (one-hot inputs reading
    single columns; the kernel's bf16 output rounds each half once) the halves are exactly ``lo * d`` and
    ``16 * d * hi`` of the table's ``q = 16 hi + lo``; a few rows project close to the float32 head; float32 keeps
    the per-group kernel."""
    model = load_gguf_model(served_tiny_dir, tiny_gguf["gguf"], dtype=torch.bfloat16)[0]
    head = model.lm_head
    assert isinstance(head, Q8Table) and head.pair is not None
    lo, hi = head.pair
    k = model.cfg.hidden_size
    eye = torch.eye(k, dtype=torch.bfloat16)[:8]  # columns 0..7 of every row, through the kernel
    q = head.q.transpose(0, 1).reshape(-1, k)[:, :8].to(torch.int32)  # [V, 8]
    d = head.d[0].float()[:, None]  # [V, 1]: group 0's scales (columns 0..7)
    assert torch.equal(lo.matmul(eye).t(), ((q & 15) * d).to(torch.bfloat16))
    assert torch.equal(hi.matmul(eye).t(), ((q >> 4) * 16 * d).to(torch.bfloat16))
    table = head.dequantize(torch.float32)  # q * d with the bf16 d, exact in float32
    hidden = torch.randn(3, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ref = F.linear(hidden.float(), table)
    torch.testing.assert_close(head.project(hidden).float(), ref, atol=5e-2, rtol=2e-2)
    assert head.nbytes == head.q.numel() + head.d.numel() * 2 + lo.nbytes + hi.nbytes
    assert load_gguf_model(served_tiny_dir, tiny_gguf["gguf"], dtype=torch.float32)[0].lm_head.pair is None


def test_copies_are_kept_head_first_within_the_budget(served_tiny_dir: Path, tiny_gguf: dict[str, Path]) -> None:
    model, cfg, _ = load_gguf_model(served_tiny_dir, tiny_gguf["gguf"], dtype=torch.bfloat16)
    before = model.parameter_bytes
    head_size = cfg.vocab_size * cfg.hidden_size * 2
    every = [model.projection(layer, name) for layer in range(cfg.num_layers) for name in PROJ_NAMES]
    packed = [w for w in every if not isinstance(w, torch.Tensor)]
    two = sum(w.shape[0] * w.shape[1] * 2 for w in packed[:2])
    assert keep_dense_copies(model, head_size + two + 1) == head_size + two
    assert model.parameter_bytes == before + head_size + two
    every = [model.projection(layer, name) for layer in range(cfg.num_layers) for name in PROJ_NAMES]
    kept = [w.dense is not None for w in every if not isinstance(w, torch.Tensor)]
    assert kept == [True, True] + [False] * (len(kept) - 2)
    rest = keep_dense_copies(model, None)
    every = [model.projection(layer, name) for layer in range(cfg.num_layers) for name in PROJ_NAMES]
    assert all(w.dense is not None for w in every if not isinstance(w, torch.Tensor))
    assert model.parameter_bytes == before + head_size + two + rest
    assert keep_dense_copies(model, None) == 0


def test_dense_copies_need_a_quantized_base(served_tiny_dir: Path) -> None:
    with pytest.raises(ConfigError, match="quantized base"):
        Settings(model=served_tiny_dir, dense_copies_mb=64).validate()
    with pytest.raises(ValueError, match="dense_copies_mb"):
        Settings(model=served_tiny_dir, quantize="int4", dense_copies_mb=-2).validate()
    Settings(model=served_tiny_dir, quantize="int4", dense_copies_mb=-1).validate()


def test_a_gguf_base_with_every_copy_kept_gives_the_reference_greedy_tokens(
    tiny_server: Callable[..., Any], tiny_gguf: dict[str, Path], served_tiny_dir: Path
) -> None:
    """Four prompts in one call: the decode steps are batches, through the copies (float32, as the reference)."""
    outputs: dict[int, list[list[int]]] = {}
    for budget in (0, -1):
        srv = tiny_server(gguf=tiny_gguf["gguf"], dense_copies_mb=budget)
        with Client(srv.target, timeout=120) as client:
            got = client.generate(PROMPTS, max_new_tokens=10, ignore_eos=True, return_token_ids=True)
            outputs[budget] = [list(g.token_ids) for g in got]
        srv.stop()
    reference = load_hf_llama(tiny_gguf["reference"])
    tokenizer = Tokenizer.from_folder(served_tiny_dir)
    for text, without, with_copies in zip(PROMPTS, outputs[0], outputs[-1], strict=True):
        assert with_copies == reference_greedy(reference, tokenizer.encode(text), 10) == without, text
