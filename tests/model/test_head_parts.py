"""``Llama.logits`` through an adapter batch: rows grouped by their head (the base, a modules_to_save replacement, a
LoRA delta on lm_head), in fp32 and in bf16 (where the top candidates are rescored in float32 with the delta),
against the same projection computed by hand in float64; states given in any order of batch rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.adapters.lora.batch import AdapterBatch, LoraTables
from service.adapters.lora.types import LoraLayer, LoraModule
from service.model.llama import EXACT_TOP
from service.model.load_folder import load_model

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize(
    ("dtype", "pairs"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
    ids=["fp32", "bf16", "bf16-pairs"],
)  # fmt: skip
def test_rows_project_through_their_own_heads(tiny_llama_dir: Path, dtype: torch.dtype, pairs: bool) -> None:
    """The base head dense, or in pairs (``PairsTable``: float32 logits from the compiled kernel)."""
    model, cfg, _ = load_model(tiny_llama_dir, dtype=dtype, device="cpu", pairs=pairs)
    g = torch.Generator().manual_seed(5)
    vocab, hidden, r = cfg.vocab_size, cfg.hidden_size, 4
    head = model.lm_head
    assert isinstance(head, torch.Tensor) != pairs
    base = head if isinstance(head, torch.Tensor) else head.dequantize()
    a = (torch.randn(r, hidden, generator=g) / hidden**0.5).to(dtype)
    b = (0.5 * torch.randn(vocab, r, generator=g)).to(dtype)
    replaced = (base.float() + 0.05 * torch.randn(vocab, hidden, generator=g)).to(dtype)
    parts = {
        "lora": LoraLayer(modules={"lm_head": LoraModule(a=a, b=b)}, nbytes=0),
        "saved": LoraLayer(modules={}, nbytes=0, saved={"lm_head": replaced}),
        "both": LoraLayer(modules={"lm_head": LoraModule(a=a, b=b)}, nbytes=0, saved={"lm_head": replaced}),
    }

    def lookup(key: object, layer: int) -> LoraLayer | None:
        return parts[str(key)] if layer == cfg.num_layers else None

    keys = [None, "lora", "saved", "both", "lora"]
    batch = AdapterBatch.build(keys, lookup, LoraTables(cfg, device=torch.device("cpu"), dtype=dtype))
    assert batch is not None
    h = torch.randn(len(keys), hidden, generator=g).to(dtype)
    got = model.logits(h, batch)  # [B, V]

    hd = h.double()
    want = [
        hd @ base.double().T,
        hd @ base.double().T + (hd @ a.double().T) @ b.double().T,
        hd @ replaced.double().T,
        hd @ replaced.double().T + (hd @ a.double().T) @ b.double().T,
        hd @ base.double().T + (hd @ a.double().T) @ b.double().T,
    ]
    for row, ref in enumerate(want):
        ref_row = ref[row]
        top = ref_row.topk(EXACT_TOP).indices
        assert int(got[row].argmax()) == int(ref_row.argmax()), row
        tol = 1e-4 if dtype == torch.float32 else 3e-2  # bf16: the delta is a bf16 matmul, rounded once
        torch.testing.assert_close(got[row, top].double(), ref_row[top], rtol=0, atol=tol)
    # The same states handed over as a subset of the batch rows, out of order: each keeps its row's head.
    picked = [3, 0, 4]
    sub = model.logits(h[picked], batch, picked)
    torch.testing.assert_close(sub, got[picked], rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2)  # matmul M
    assert batch.head_parts(None, len(keys)) is not None
    plain = AdapterBatch.build(["x"], lambda key, layer: None, LoraTables(cfg, device=torch.device("cpu"), dtype=dtype))
    assert plain is not None and plain.head_parts(None, 1) is None  # no head part: the base path, no grouping
