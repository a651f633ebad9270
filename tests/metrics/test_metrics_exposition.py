"""The /metrics endpoint of a running server, linted by Prometheus' own ``promtool check metrics``.

A real server (tiny random Llama, SmolLM2's tokenizer) is started with ``metrics_port=0`` and two adapters
registered lazily: a PEFT LoRA and Medusa heads. It serves base-model generations, the first request for the LoRA
(a cold load: miss, read, layout) and a second one (a hit), and a greedy generation with the heads (speculative
decoding: drafts proposed and verified), so histograms and labelled series have samples; then it is scraped over
HTTP. promtool comes from Debian's ``prometheus`` package (``scripts/system_deps.sh``).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.metrics import scrape_live_server, series_names, write_live_adapters

from service.metrics import REGISTRY


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
def live_scrape(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    adapters = write_live_adapters(tmp_path_factory.mktemp("live_adapters"), served_tiny_dir)
    yield scrape_live_server(served_tiny_dir, adapters)


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
        "loraplex_adapter_load_duration_seconds",
    }
    for name in observed:
        counts = [s.value for s in scraped[name].samples if s.name == f"{name}_count"]
        assert counts and min(counts) >= 1, f"{name} has no observations"

    def value(family: str, sample: str, **labels: str) -> float:
        found = [s.value for s in scraped[family].samples if s.name == sample and s.labels == labels]
        assert len(found) == 1, f"{sample}{labels}: {found}"
        return found[0]

    # 3 base + 2 LoRA generations x 6 tokens, 16 speculative ones (the registry is per process: at least).
    assert value("loraplex_generated_tokens", "loraplex_generated_tokens_total") >= 3 * 6 + 2 * 6 + 16

    def events(event: str, tier: str) -> float:
        return value("loraplex_adapter_cache_events", "loraplex_adapter_cache_events_total", event=event, tier=tier)

    # The cold LoRA load: a device-tier miss whose bytes came from disk (a host-tier miss), then a hit.
    assert events("miss", "device") >= 1 and events("miss", "host") >= 1 and events("hit", "device") >= 1
    assert value("loraplex_adapter_read_bytes", "loraplex_adapter_read_bytes_total") > 0
    stages = {
        s.labels["stage"]
        for s in scraped["loraplex_adapter_load_duration_seconds"].samples
        if s.name.endswith("_count") and s.value >= 1
    }
    assert {"index", "read", "layout", "total"} <= stages, stages
    # The gauge counts the LoRA store's adapters; Medusa-only folders live in the heads registry.
    assert value("loraplex_adapters_registered", "loraplex_adapters_registered") >= 1
    assert value("loraplex_adapter_resident", "loraplex_adapter_resident", tier="device") >= 1
    # Speculative decoding ran: drafts proposed and verified, accepted ones counted (possibly none: random heads).
    steps = value("loraplex_speculative_steps", "loraplex_speculative_steps_total")
    drafted = value("loraplex_speculative_drafted_tokens", "loraplex_speculative_drafted_tokens_total")
    accepted = value("loraplex_speculative_accepted_tokens", "loraplex_speculative_accepted_tokens_total")
    assert steps >= 1 and drafted >= steps and 0 <= accepted <= drafted


def test_promtool_rejects_a_bad_exposition() -> None:
    """The check can fail: a non-base unit is a lint error promtool reports with a non-zero exit."""
    registry = CollectorRegistry()
    Gauge("loraplex_test_latency_milliseconds", "Latency in the wrong unit.", registry=registry).set(1)
    proc = promtool_check(generate_latest(registry).decode())
    assert proc.returncode != 0
    assert "milliseconds" in proc.stdout + proc.stderr
