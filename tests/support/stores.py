"""Shared helpers for adapter-store tests: a CPU store with test budgets.

`conftest.py` wraps it in the ``make_store`` fixture (stores closed at teardown); a test that builds a store
itself with ``new_store`` closes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from service.adapters.lora.store import AdapterStore
from service.model.config import ModelConfig


def new_store(
    cfg: ModelConfig,
    *,
    device_budget: int = 1 << 20,
    host_budget: int = 1 << 20,
    dtype: torch.dtype = torch.float32,
    roots: Sequence[Path] = (),
    overflow: int = 0,
) -> AdapterStore:
    """An adapter store on CPU for ``cfg`` with these tier budgets (bytes) and overflow copies (adapters)."""
    return AdapterStore(
        cfg, device=torch.device("cpu"), dtype=dtype, device_budget_bytes=device_budget,
        host_budget_bytes=host_budget, roots=roots, overflow_adapters=overflow,
    )  # fmt: skip
