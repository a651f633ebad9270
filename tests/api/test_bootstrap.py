"""service.bootstrap, the composition root: its tables name every weight format and quantized kind, and ``build``
returns the runtime's parts with the load's metrics recorded and the engine not yet started."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.servers import tiny_settings

from service import bootstrap, metrics
from service.config import QUANTIZE
from service.errors import Unavailable
from service.model.dtypes import DtypeChoice, ServingChoice
from service.model.weights import QUANTIZERS


def test_every_quantize_choice_has_a_quantizer() -> None:
    assert set(QUANTIZE) - {"none"} == set(QUANTIZERS)


@pytest.mark.parametrize("gguf", [False, True])
def test_every_weight_source_has_a_format(gguf: bool) -> None:
    assert ServingChoice(DtypeChoice(torch.float32, "given"), gguf, "given").weights in bootstrap.WEIGHT_FORMATS


def test_build_returns_the_parts_with_the_load_recorded(served_tiny_dir: Path) -> None:
    s = tiny_settings(served_tiny_dir, quantize="int8", dense_copies_mb=-1)
    count = {"stage": "total", "mode": s.load_mode}
    before = metrics.REGISTRY.get_sample_value("loraplex_model_load_duration_seconds_count", count) or 0.0
    parts = bootstrap.build(s)
    try:
        assert parts.choice.weights == "folder" and parts.stats.mode == s.load_mode
        assert parts.model.quantized and all(w.dense is not None for _, _, w in parts.model.compact_projections())
        assert metrics.REGISTRY.get_sample_value("loraplex_model_load_duration_seconds_count", count) == before + 1
        assert metrics.REGISTRY.get_sample_value("loraplex_model_parameter_bytes") == parts.model.parameter_bytes
        assert any(c.path.startswith("int8 projection") for c in parts.self_check.checks)
        assert not parts.engine.alive
    finally:
        parts.adapters.close(0)


def test_a_runtime_closed_meanwhile_stops_the_build_before_the_weights(served_tiny_dir: Path) -> None:
    calls: list[int] = []

    def closed() -> None:
        calls.append(1)
        raise Unavailable("the server was stopped while the model was loading")

    with pytest.raises(Unavailable):
        bootstrap.build(tiny_settings(served_tiny_dir), check_open=closed)
    assert calls == [1]
