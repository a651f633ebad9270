"""Every dashboard query, evaluated by a real Prometheus (Debian's ``prometheus``) scraping a live loraplex.

A server (tiny random Llama, SmolLM2's tokenizer; LoRAs and Medusa heads; a device budget that holds one LoRA,
so they evict each other) serves mixed traffic twice: base, streamed, LoRA (cold, warm, evicted), speculative,
an unknown adapter (NOT_FOUND) and a client deadline. Between the rounds Prometheus scrapes every 0.5 s, so each
series it stores has samples before and after an increase and every ``rate`` has something to show. Then every
panel query (Grafana's variables substituted) goes through Prometheus' HTTP API; a query that returns nothing, or
only NaN, fails the test. Every panel has data.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.metrics import live_metrics_settings, load_dashboard, panels, speculate_once, write_live_adapters
from support.servers import free_port

from service.api.server import BackgroundServer

SCRAPE = "500ms"
RATE_INTERVAL = "1m"  # covers both traffic rounds
RANGE = "10m"


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is missing: run scripts/system_deps.sh (Debian package `prometheus`)")
    return path


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read().decode())


class Prometheus:
    """A Prometheus server in a temporary folder scraping one target; stopped on exit."""

    def __init__(self, folder: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = folder / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {SCRAPE}\n  scrape_timeout: {SCRAPE}\n"
            f"scrape_configs:\n  - job_name: loraplex\n    static_configs:\n      - targets: ['{target}']\n"
        )
        self.log = (folder / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_up(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "prometheus exited; see its log"
            try:
                targets = http_json(f"{self.url}/api/v1/targets")["data"]["activeTargets"]
                if targets and all(t["health"] == "up" for t in targets):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        pytest.fail("prometheus did not scrape the server in time")

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = http_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def traffic(stub: pb_grpc.GenerationStub, round_: int) -> None:
    """One round of everything the dashboard plots: base, stream, two LoRAs (evicting each other), speculation,
    an unknown adapter, a request whose client deadline passes mid-generation, and constrained requests (a schema
    new in this round: a compile, then a cache hit)."""
    short = pb.StoppingCriteria(max_new_tokens=6, ignore_eos=True)
    for _ in range(2):
        digits = pb.Constraint(regex=f"[0-9]{{4,{9 + round_}}}")
        stub.Generate(pb.GenerateRequest(inputs=[pb.Input(text="N")], stopping=short, constraint=digits), timeout=60)
    stub.Generate(pb.GenerateRequest(inputs=[pb.Input(text="Hello"), pb.Input(text="Hi")], stopping=short), timeout=60)
    list(stub.GenerateStream(pb.GenerateStreamRequest(input=pb.Input(text="Count"), stopping=short), timeout=60))
    for adapter in ("lora", "lora", "other_lora", "lora"):
        stub.Generate(pb.GenerateRequest(inputs=[pb.Input(text="A")], adapter_id=adapter, stopping=short), timeout=60)
    speculate_once(stub)
    with pytest.raises(grpc.RpcError) as missing:
        stub.Generate(pb.GenerateRequest(inputs=[pb.Input(text="A")], adapter_id="nope", stopping=short), timeout=60)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as late:
        stub.Generate(
            pb.GenerateRequest(
                inputs=[pb.Input(text="Long")], stopping=pb.StoppingCriteria(max_new_tokens=900, ignore_eos=True)
            ),
            timeout=0.5,  # 900 tokens take seconds: the deadline passes mid-generation
        )
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.fixture(scope="module")
def prometheus(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    root = write_live_adapters(tmp_path_factory.mktemp("prom_adapters"), served_tiny_dir)
    shutil.copytree(root / "lora", root / "other_lora")
    one_lora = sum(f.stat().st_size for f in (root / "lora").glob("*.safetensors"))
    settings = live_metrics_settings(
        served_tiny_dir,
        root,
        adapter_device_budget_bytes=one_lora * 3 // 2,  # one LoRA fits, two do not: loads evict
        adapter_host_budget_bytes=one_lora * 3 // 2,
    )
    with BackgroundServer(settings) as srv:
        assert srv.server is not None and srv.server.metrics_port is not None
        prom = Prometheus(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{srv.server.metrics_port}")
        try:
            prom.wait_up()
            with grpc.insecure_channel(srv.target) as channel:
                stub = pb_grpc.GenerationStub(channel)
                for round_ in range(2):  # the first round creates the series, the second increases them
                    traffic(stub, round_)
                    time.sleep(2.0)  # a few scrapes
            yield prom
        finally:
            prom.close()


def substitute(expr: str) -> str:
    for var, value in (
        ("$__rate_interval", RATE_INTERVAL),
        ("$__range", RANGE),
        ("$instance", ".*"),
        ("$adapter", ".*"),
    ):
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(series["value"][1])) for series in result)


def dashboard_queries() -> list[tuple[str, str, str]]:
    return [(p["title"], t.get("legendFormat", ""), t["expr"]) for p in panels(load_dashboard()) for t in p["targets"]]


@pytest.mark.slow
def test_every_dashboard_query_has_data(prometheus: Prometheus) -> None:
    empty = []
    for title, legend, expr in dashboard_queries():
        if not has_data(prometheus.query(substitute(expr))):
            empty.append(f"{title} [{legend}]: {expr}")
    assert not empty, "queries without data after the traffic:\n" + "\n".join(empty)


@pytest.mark.slow
def test_variables_have_values(prometheus: Prometheus) -> None:
    for var in load_dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        metric, label = var["query"]["query"].removeprefix("label_values(").rstrip(")").split(", ")
        values = {s["metric"].get(label, "") for s in prometheus.query(metric)}
        assert values, var["name"]
    adapters = {s["metric"].get("adapter", "") for s in prometheus.query("loraplex_adapter_requests_total")}
    assert {"", "lora", "other_lora", "medusa", "other"} <= adapters, adapters


@pytest.mark.slow
def test_model_load_panel_shows_the_last_load(prometheus: Prometheus) -> None:
    """The panel that was a NaN p99 now shows each stage's seconds; the old query still returns nothing finite."""
    (title, _, expr) = next(q for q in dashboard_queries() if q[0].startswith("Model load by stage"))
    stages = {s["metric"]["stage"]: float(s["value"][1]) for s in prometheus.query(substitute(expr))}
    assert stages["total"] > 0 and stages["read"] > 0 and stages["total"] >= stages["read"], (title, stages)
    old = (
        f"histogram_quantile(0.99, sum by (le, stage) (increase(loraplex_model_load_duration_seconds_bucket[{RANGE}])))"
    )
    assert not has_data(prometheus.query(old))


@pytest.mark.slow
def test_timeouts_show_in_the_error_panel(prometheus: Prometheus) -> None:
    (_, _, expr) = next(q for q in dashboard_queries() if q[:2] == ("Error ratio", "timeouts (generation)"))
    assert has_data(prometheus.query(substitute(expr)))
    assert float(prometheus.query(substitute(expr))[0]["value"][1]) > 0


@pytest.mark.slow
def test_client_deadlines_counted_as_deadline_exceeded(prometheus: Prometheus) -> None:
    codes = {s["metric"]["code"] for s in prometheus.query("loraplex_requests_total")}
    assert "DEADLINE_EXCEEDED" in codes, codes
    (title, _, expr) = next(q for q in dashboard_queries() if q[:2] == ("Error ratio", "{{code}} (all RPCs)"))
    assert has_data(prometheus.query(substitute(expr))), title
