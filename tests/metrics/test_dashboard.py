"""The Grafana dashboard deploy/grafana/loraplex.json: valid, portable, and plotting only metrics that exist.

Every panel query is parsed with promql-parser (after Grafana's variables are substituted) and each series it
selects must be one that ``service.metrics.REGISTRY`` declares and that a running server exports (one with a LoRA
and Medusa heads that has served a cold adapter load and speculative decoding). Every declared metric is either
plotted or named in docs/operations.md's list of metrics left off the dashboard.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from prometheus_client import Histogram
from prometheus_client.parser import text_string_to_metric_families
from support.metrics import (
    DASHBOARD,
    Obj,
    load_dashboard,
    panels,
    scrape_live_server,
    series_names,
    write_live_adapters,
)
from support.paths import ROOT

from service import metrics
from service.metrics import REGISTRY

OPERATIONS = ROOT / "docs" / "operations.md"
LEFT_OUT_HEADING = "### Metrics not on the dashboard"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's interval variables become durations; any other variable sits in a regex matcher and becomes ".*".
INTERVALS = re.compile(r"\$(?:\{(?:__rate_interval|__interval|__range)\}|__rate_interval|__interval|__range)\b")
VARIABLE = re.compile(r"\$(?:\{\w+(?::\w+)?\}|\w+)")


def queries(dashboard: Obj) -> Iterator[tuple[str, str]]:
    for panel in panels(dashboard):
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def substitute(expr: str) -> str:
    text = VARIABLE.sub(".*", INTERVALS.sub("5m", expr))
    assert "$" not in text, text
    return text


def parse(expr: str) -> Any:
    return promql_parser.parse(substitute(expr))


def selected_metrics(expr: str) -> set[str]:
    """Names of the series a query selects (vector selectors, also those inside range selectors)."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"selector without a metric name in {expr!r}"
            names.add(node.name)

    promql_parser.walk(parse(expr), visit)
    return names


def selector_names(node: Any) -> frozenset[str]:
    """Metric names of the vector selectors anywhere under ``node`` of a parsed query."""
    names: set[str] = set()

    def visit(n: Any) -> None:
        if isinstance(n, promql_parser.VectorSelector) and n.name:
            names.add(n.name)

    promql_parser.walk(node, visit)
    return frozenset(names)


def variable_metrics(dashboard: Obj) -> set[str]:
    names: set[str] = set()
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+), *(\w+)\)", var["query"]["query"])
            assert match is not None, var["query"]
            names.add(match.group(1))
    return names


def dashboard_metrics(dashboard: Obj) -> set[str]:
    used = variable_metrics(dashboard)
    for _, expr in queries(dashboard):
        used |= selected_metrics(expr)
    return used


@pytest.fixture(scope="module")
def live_series(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    adapters = write_live_adapters(tmp_path_factory.mktemp("dashboard_adapters"), served_tiny_dir)
    return series_names(text_string_to_metric_families(scrape_live_server(served_tiny_dir, adapters)))


def test_dashboard_is_portable_grafana_json() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "loraplex" and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    # No hard-coded data source anywhere: every panel, target and query variable uses ${datasource}.
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == DATASOURCE
    uids = re.findall(r'"uid":\s*"([^"]*)"', DASHBOARD.read_text())
    assert set(uids) == {"loraplex", "${datasource}"}


def test_layout_ids_and_grid() -> None:
    dashboard = load_dashboard()
    ids = [p["id"] for p in dashboard["panels"]] + [n["id"] for p in dashboard["panels"] for n in p.get("panels", [])]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_query_parses() -> None:
    exprs = list(queries(load_dashboard()))
    assert len(exprs) >= 20
    for title, expr in exprs:
        try:
            parse(expr)
        except Exception as exc:  # promql_parser raises plain ValueErrors / TypeErrors
            pytest.fail(f"{title}: {expr!r} does not parse: {exc}")


def test_parser_rejects_a_broken_query() -> None:
    with pytest.raises(Exception, match=r"."):
        parse("sum(rate(loraplex_generated_tokens_total[$__rate_interval])")


def test_quantiles_aggregate_buckets_by_le() -> None:
    found = 0
    for title, expr in queries(load_dashboard()):

        def visit(node: Any, title: str = title) -> None:
            nonlocal found
            if isinstance(node, promql_parser.Call) and node.func.name == "histogram_quantile":
                found += 1
                agg = node.args[1]
                assert isinstance(agg, promql_parser.AggregateExpr), title
                assert agg.modifier is not None and agg.modifier.type == promql_parser.AggModifierType.By, title
                assert "le" in agg.modifier.labels, title
                inner = selector_names(agg)
                assert inner and all(name.endswith("_bucket") for name in inner), title

        promql_parser.walk(parse(expr), visit)
    assert found >= 8


def test_required_panels_are_there() -> None:
    dashboard = load_dashboard()
    exprs = [expr for _, expr in queries(dashboard)]

    def quantiles_of(metric: str) -> set[str]:
        return {m for e in exprs if f"{metric}_bucket" in e for m in re.findall(r"histogram_quantile\(([\d.]+)", e)}

    for metric in ("loraplex_time_to_first_token_seconds", "loraplex_inter_token_latency_seconds"):
        assert {"0.5", "0.99"} <= quantiles_of(metric), metric
    assert any("loraplex_model_load_duration_seconds" in e and "by (stage" in e for e in exprs)
    used = dashboard_metrics(dashboard)
    for metric in (
        "loraplex_generated_tokens_total",
        "loraplex_prompt_tokens_total",
        "loraplex_requests_total",
        "loraplex_running_requests",
        "loraplex_waiting_requests",
        "loraplex_batch_size_bucket",
        "loraplex_kv_cache_usage_ratio",
        "loraplex_request_queue_seconds_bucket",
    ):
        assert metric in used, metric
    # Adapter panels, once the adapter metrics exist (they do when service/metrics.py declares them).
    declared = {family.name for family in REGISTRY.collect()}
    if "loraplex_adapter_load_duration_seconds" in declared:
        assert any("loraplex_adapter_load_duration_seconds" in e and "stage" in e for e in exprs)
        assert "loraplex_adapter_cache_events_total" in used


def test_overflow_panel_uses_each_histograms_top_bucket() -> None:
    """The share past the top finite bucket, for every request latency whose quantiles the dashboard plots."""
    overflow = "Latency observations past the top bucket"
    (panel,) = [p for p in panels(load_dashboard()) if p["title"].startswith(overflow)]
    histograms = {m._name: m for m in vars(metrics).values() if isinstance(m, Histogram)}
    covered = set()
    for target in panel["targets"]:
        found = re.search(r'(\w+)_bucket\{le="([^"]+)"', target["expr"])
        assert found is not None, target["expr"]
        name, le = found.groups()
        assert float(le) == histograms[name]._upper_bounds[-2], name  # the last finite bound ([-1] is +Inf)
        assert f"{name}_count" in target["expr"]
        covered.add(name)
    assert covered == {
        "loraplex_time_to_first_token_seconds",
        "loraplex_request_queue_seconds",
        "loraplex_request_duration_seconds",
    }


def ratios(dashboard: Obj) -> set[tuple[frozenset[str], frozenset[str]]]:
    """(metrics selected by the numerator, by the denominator) of every division in every query."""
    found: set[tuple[frozenset[str], frozenset[str]]] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.BinaryExpr) and str(node.op) == "/":
            found.add((selector_names(node.lhs), selector_names(node.rhs)))

    for _, expr in queries(dashboard):
        promql_parser.walk(parse(expr), visit)
    return found


def test_speculative_panels() -> None:
    """Acceptance rate = accepted / drafted; tokens per step = 1 + accepted / steps (service/metrics.py's docs)."""
    dashboard = load_dashboard()
    found = ratios(dashboard)
    accepted = frozenset({"loraplex_speculative_accepted_tokens_total"})
    assert (accepted, frozenset({"loraplex_speculative_drafted_tokens_total"})) in found
    assert (accepted, frozenset({"loraplex_speculative_steps_total"})) in found
    assert any(e.startswith("1 + ") and "loraplex_speculative_steps_total" in e for _, e in queries(dashboard))
    titles = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert "Speculative decoding" in titles


def left_out_metrics() -> dict[str, str]:
    """The table under LEFT_OUT_HEADING in docs/operations.md: metric name -> why it is not plotted."""
    text = OPERATIONS.read_text()
    assert LEFT_OUT_HEADING in text, f"{OPERATIONS} lacks {LEFT_OUT_HEADING!r}"
    section = text.split(LEFT_OUT_HEADING, 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \|$", section, re.MULTILINE)
    assert rows, "no `metric` | reason rows in the left-out table"
    return dict(rows)


def test_every_declared_metric_is_plotted_or_consciously_left_out() -> None:
    used = dashboard_metrics(load_dashboard())
    left_out = left_out_metrics()
    unaccounted, doubly = [], []
    for family in REGISTRY.collect():
        exposed = series_names([family]) - {family.name + "_created"}
        listed = exposed & set(left_out)
        if exposed & used and listed:
            doubly.append(family.name)
        elif not exposed & used and not listed:
            unaccounted.append(sorted(exposed))
    assert not unaccounted, f"neither plotted nor listed under {LEFT_OUT_HEADING!r}: {unaccounted}"
    assert not doubly, f"plotted, yet listed as left out: {doubly}"
    declared = series_names(REGISTRY.collect())
    assert set(left_out) <= declared, f"listed as left out but not declared: {sorted(set(left_out) - declared)}"


def test_queries_use_declared_metrics() -> None:
    declared = series_names(REGISTRY.collect())
    missing = dashboard_metrics(load_dashboard()) - declared
    assert not missing, f"the dashboard plots series service.metrics does not declare: {sorted(missing)}"


def test_declared_series_check_is_exact() -> None:
    """A counter family's bare name or a histogram's base name is not a series: the check must reject them."""
    declared = series_names(REGISTRY.collect())
    assert "loraplex_requests_total" in declared and "loraplex_requests" not in declared
    assert "loraplex_time_to_first_token_seconds_bucket" in declared
    assert "loraplex_time_to_first_token_seconds" not in declared
    assert selected_metrics("rate(loraplex_requests[$__rate_interval])") - declared == {"loraplex_requests"}


@pytest.mark.slow
def test_queries_use_metrics_a_running_server_exports(live_series: set[str]) -> None:
    missing = dashboard_metrics(load_dashboard()) - live_series
    assert not missing, f"a running server does not export: {sorted(missing)}"
