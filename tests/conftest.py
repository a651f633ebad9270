"""Shared fixtures. Tests run on CPU, offline; the real SmolLM2 folder comes from `make model`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_DIR = Path(os.environ.get("LORAPLEX_TEST_MODEL", ROOT / "models" / "SmolLM2-135M-Instruct"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model. `make test` fetches it first; running pytest alone needs `make model`."""
    if not (SMOLLM2_DIR / "config.json").exists():
        pytest.fail(f"{SMOLLM2_DIR} is missing: run `make model` (make test does it for you)")
    return SMOLLM2_DIR
