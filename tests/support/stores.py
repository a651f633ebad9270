"""Shared helpers for adapter-store tests: a CPU store with test budgets.

`conftest.py` wraps it in the ``make_store`` fixture (stores closed at teardown); a test that builds a store
itself with ``new_store`` closes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def three_adapters_served(model_dir: Path, root: Path, *, seed: int) -> dict[str, Any]:
    """Adapters "x", "y", "z" (r=8, every projection, seeds ``seed``..) written under ``root`` over the served model
    in ``model_dir``, and that model loaded in fp32 on CPU: what the engine-level tier tests serve."""
    from service.model.load_folder import load_model
    from support.adapter_files import write_peft_adapter

    names = ("x", "y", "z")
    for i, n in enumerate(names):
        write_peft_adapter(root / n, model_dir, r=8, target_modules="all-linear", seed=seed + i, scale=0.5)
    model, cfg, _ = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    return {"root": root, "names": names, "model": model, "cfg": cfg, "dir": model_dir}
