"""The /metrics endpoint of a running server, linted by Prometheus' own ``promtool check metrics``.

A real server (tiny random Llama, SmolLM2's tokenizer) is started with ``metrics_port=0``, serves a few
generations so histograms and labelled series have samples, and is scraped over HTTP. promtool comes from
Debian's ``prometheus`` package (``scripts/system_deps.sh``).
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc
import pytest
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from service.api.server import BackgroundServer
from service.config import Settings
from service.metrics import REGISTRY

# The series names a family of each type puts in the text exposition (prometheus_client names a counter's
# family without its ``_total``; an info metric is exposed as a gauge called ``<name>_info``).
SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "gauge": ("",),
    "stateset": ("",),
    "enum": ("",),
    "unknown": ("",),
}


def series_names(families: Iterable[Metric]) -> set[str]:
    """Every series name these families expose, whether or not a labelled family has children yet."""
    names: set[str] = set()
    for family in families:
        names.update(family.name + suffix for suffix in SERIES_SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def scrape_live_server(model_dir: Path) -> str:
    """Start a server on free ports, run a unary and a streamed generation, return its /metrics text."""
    settings = Settings(
        model=model_dir,
        port=0,
        metrics_port=0,
        max_batch_size=4,
        max_queue=8,
        max_prompt_tokens=128,
        max_new_tokens=32,
        max_total_tokens=256,
    )
    stopping = pb.StoppingCriteria(max_new_tokens=6, ignore_eos=True)
    with BackgroundServer(settings) as srv:
        assert srv.server is not None and srv.server.metrics_port is not None
        with grpc.insecure_channel(srv.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            stub.Generate(
                pb.GenerateRequest(inputs=[pb.Input(text="Hello"), pb.Input(text="Hi there")], stopping=stopping),
                timeout=60,
            )
            chunks = list(
                stub.GenerateStream(
                    pb.GenerateStreamRequest(input=pb.Input(text="Count"), stopping=stopping), timeout=60
                )
            )
            assert chunks and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        url = f"http://{settings.metrics_host}:{srv.server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            body: str = response.read().decode()
    return body


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: run scripts/system_deps.sh (Debian package `prometheus`)")
    return path


def promtool_check(exposition: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def live_scrape(served_tiny_dir: Path) -> Iterator[str]:
    yield scrape_live_server(served_tiny_dir)


@pytest.mark.slow
def test_promtool_accepts_the_live_exposition(live_scrape: str) -> None:
    proc = promtool_check(live_scrape)
    assert proc.returncode == 0, f"promtool check metrics:\n{proc.stdout}{proc.stderr}"


@pytest.mark.slow
def test_live_exposition_declares_every_metric_with_samples(live_scrape: str) -> None:
    scraped = {family.name: family for family in text_string_to_metric_families(live_scrape)}
    declared = series_names(REGISTRY.collect())
    exported = series_names(scraped.values())
    assert declared <= exported, f"not exported: {sorted(declared - exported)}"
    # The requests above must have reached the histograms and counters the dashboard plots.
    observed = {
        "loraplex_model_load_duration_seconds",
        "loraplex_time_to_first_token_seconds",
        "loraplex_inter_token_latency_seconds",
        "loraplex_request_duration_seconds",
        "loraplex_request_queue_seconds",
        "loraplex_batch_size",
    }
    for name in observed:
        counts = [s.value for s in scraped[name].samples if s.name == f"{name}_count"]
        assert counts and min(counts) >= 1, f"{name} has no observations"
    generated = [s.value for s in scraped["loraplex_generated_tokens"].samples if s.name.endswith("_total")]
    assert generated and generated[0] >= 18  # 3 generations x 6 tokens (the registry is per process)


def test_promtool_rejects_a_bad_exposition() -> None:
    """The check can fail: a non-base unit is a lint error promtool reports with a non-zero exit."""
    registry = CollectorRegistry()
    Gauge("loraplex_test_latency_milliseconds", "Latency in the wrong unit.", registry=registry).set(1)
    proc = promtool_check(generate_latest(registry).decode())
    assert proc.returncode != 0
    assert "milliseconds" in proc.stdout + proc.stderr
