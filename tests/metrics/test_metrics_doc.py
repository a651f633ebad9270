"""The metrics table in docs/metrics.md and service/metrics.py stay in step: every metric documented, nothing stale."""

from __future__ import annotations

import re

from prometheus_client.metrics import MetricWrapperBase
from support.paths import ROOT

from service import metrics

PAGE = ROOT / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(loraplex_[a-z0-9_]+)` \| (\w+) \| ([^|]*) \|", re.M)


def declared() -> dict[str, tuple[str, tuple[str, ...]]]:
    out = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            suffix = {"counter": "_total", "info": "_info"}.get(value._type, "")
            out[value._name + suffix] = (value._type, tuple(value._labelnames))
    return out


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    rows = {}
    for name, kind, labels in ROW.findall(PAGE.read_text()):
        rows[name] = (kind, tuple(x.strip(" `") for x in labels.split(",") if x.strip(" `—-")))
    return rows


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    ours, doc = declared(), documented()
    assert set(ours) - set(doc) == set(), "metrics missing from docs/metrics.md's table"
    assert set(doc) - set(ours) == set(), "docs/metrics.md documents metrics that do not exist"
    for name, (kind, labels) in ours.items():
        assert doc[name] == (kind, labels), name


def test_conventions() -> None:
    capped = {f"{family._name}" for family in metrics.PER_ADAPTER}
    for name, (kind, labels) in declared().items():
        if kind == "counter":
            assert name.endswith("_total")
        assert "adapter_id" not in labels, f"{name}: no unbounded adapter label"
        # An adapter label only on the families whose values go through metrics.ADAPTERS (the cardinality cap).
        assert ("adapter" in labels) == (name.removesuffix("_total") in capped), name
