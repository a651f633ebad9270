"""What Medusa heads draft through (``Llama.draft_head``): a GGUF's Q8_0 head itself, on its compiled kernel, up to
its ``draft_rows``, so that no dense copy of the vocabulary matrix is made for a batch that small; past them the
dense copy. Either way a head's candidates are those of the head's own logits (float32 from the table: its top-k)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.gguf_files import write_tiny_gguf
from support.stack_models import load_q4

from service.adapters.medusa.heads import MedusaHeads
from service.model import Llama
from service.model.weights.q8_table import DRAFT_MAX_ROWS, Q8Table


@pytest.fixture(scope="module")
def q4_model(tiny_llama_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Llama:
    """A tiny GGUF whose output head is Q8_0 (as SmolLM2's tied one is), the projections 4-bit."""
    folder = tiny_llama_factory(seed=5)
    types = {"token_embd": "Q8_0", "attn_output": "Q4_1", "output": "Q8_0"}
    return load_q4(folder, write_tiny_gguf(folder, tmp_path_factory.mktemp("q8") / "q8.gguf", types=types))


def _heads(model: Llama, n: int) -> MedusaHeads:
    """``n`` random v2 heads (one residual block each; projecting with the base model's head)."""
    h, g = model.cfg.hidden_size, torch.Generator().manual_seed(n)
    return MedusaHeads(2, torch.randn(1, n, h, h, generator=g) * 0.05, torch.zeros(1, n, h))


def test_a_q8_head_drafts_few_rows_on_its_kernel_without_a_dense_copy(q4_model: Llama) -> None:
    head = q4_model.lm_head
    assert isinstance(head, Q8Table) and head.native is not None and head.draft_rows == DRAFT_MAX_ROWS
    q4_model._draft_head = None
    heads, x = _heads(q4_model, 3), torch.randn(2, q4_model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    assert q4_model.draft_head(2 * 3) is head
    got = heads.topk(x, q4_model.draft_head(2 * 3), 4)  # [2, 3, 4]
    assert q4_model._draft_head is None  # no copy made
    want = head.project(heads.hidden(x)).topk(4, dim=-1).indices  # the head's own float32 logits
    assert torch.equal(got, want)
    dense = q4_model.draft_head(DRAFT_MAX_ROWS + 1)  # past them: the dense copy, made once
    assert isinstance(dense, torch.Tensor) and dense.shape == head.shape and q4_model._draft_head is dense
    close = torch.nn.functional.linear(heads.hidden(x).to(dense.dtype), dense).float()
    assert torch.allclose(close, head.project(heads.hidden(x)), atol=0.05, rtol=0.02)  # the same head, rounded
