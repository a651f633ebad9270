"""Per-adapter metrics and their cardinality cap (``service.metrics.AdapterLabels``, ``--metrics-adapter-series``).

The label policy is walked step by step on its own; then a real server (tiny random Llama, SmolLM2's tokenizer)
with five adapters registered and a cap of two serves traffic over gRPC and is scraped over HTTP: the first two
adapters served get their own series, later ones, unknown ids and nothing else land in ``adapter="other"``, the
base model in ``adapter=""``, and no per-adapter family ever holds more than two adapter ids. Last, the real
SmolLM2 with the image's demo adapters (caps, terse, medusa): each gets its own series after one request.
"""

from __future__ import annotations

import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families
from support.metrics import live_metrics_settings, write_live_adapters
from support.paths import ROOT
from support.wait import wait_until

from service import metrics
from service.api.server import BackgroundServer
from service.config import Settings
from service.metrics import AdapterLabels

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def test_labels_first_come_then_other() -> None:
    labels = AdapterLabels(2)
    assert labels.label(None) == labels.label("") == AdapterLabels.BASE == ""
    assert labels.values == ()
    assert labels.label("ghost", admit=False) == "other" and labels.values == ()  # unknown ids take no slot
    assert labels.label("a") == "a" and labels.values == ("a",)
    assert labels.label("b") == "b" and labels.values == ("a", "b")
    assert labels.label("c") == "other" and labels.values == ("a", "b")  # over the cap
    assert labels.label("a", admit=False) == "a"  # a held slot is kept, admitted or not
    assert labels.label("b") == "b" and labels.values == ("a", "b")
    assert AdapterLabels(0).label("a") == "other"


def test_reset_clears_slots_and_series() -> None:
    labels = AdapterLabels(1)
    labels.label("a")
    labels.reset(3)
    assert labels.cap == 3 and labels.values == ()
    with pytest.raises(ValueError, match="metrics_adapter_series"):
        labels.reset(-1)


def test_setting_rejects_a_negative_cap() -> None:
    assert Settings.from_env({"LORAPLEX_METRICS_ADAPTER_SERIES": "5"}).metrics_adapter_series == 5
    with pytest.raises(ValueError, match="metrics_adapter_series"):
        Settings.from_env({"LORAPLEX_METRICS_ADAPTER_SERIES": "-1"})


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def capped_scrape(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Samples:
    root = write_live_adapters(tmp_path_factory.mktemp("capped_adapters"), served_tiny_dir)
    for name in ("a", "b", "c", "d"):
        shutil.copytree(root / "lora", root / name)
    shutil.rmtree(root / "lora")
    settings = live_metrics_settings(served_tiny_dir, root, metrics_adapter_series=2, speculate_adaptive=False)
    stopping = pb.StoppingCriteria(max_new_tokens=5, ignore_eos=True)
    with BackgroundServer(settings) as srv:
        assert srv.server is not None and srv.server.metrics_port is not None
        with grpc.insecure_channel(srv.target) as channel:
            stub = pb_grpc.GenerationStub(channel)

            def generate(adapter: str) -> None:
                stub.Generate(
                    pb.GenerateRequest(inputs=[pb.Input(text="Hi")], adapter_id=adapter, stopping=stopping), timeout=60
                )

            for adapter in ("", "a", "a", "b", "c", "d", "medusa"):
                generate(adapter)
            list(
                stub.GenerateStream(
                    pb.GenerateStreamRequest(input=pb.Input(text="Go"), adapter_id="b", stopping=stopping), timeout=60
                )
            )
            with pytest.raises(grpc.RpcError) as missing:
                generate("nope")
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as late:  # 900 tokens take seconds: the deadline passes mid-generation
                stub.Generate(
                    pb.GenerateRequest(
                        inputs=[pb.Input(text="Long")],
                        adapter_id="a",
                        stopping=pb.StoppingCriteria(max_new_tokens=900, ignore_eos=True),
                    ),
                    timeout=0.5,
                )
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert metrics.ADAPTERS.values == ("a", "b")
        # The late request's handler may still be unwinding when the client gives up: wait for its sample.
        for _ in range(100):
            samples = scrape(srv.server.metrics_port)
            if value(samples, "loraplex_adapter_requests_total", adapter="a", code="DEADLINE_EXCEEDED"):
                break
            srv.call(_sleep(0.05))
    return samples


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


@pytest.mark.slow
def test_per_adapter_series_stay_under_the_cap(capped_scrape: Samples) -> None:
    per_adapter = {f._name for f in metrics.PER_ADAPTER}
    seen = {
        dict(labels)["adapter"]
        for (name, labels), _ in capped_scrape.items()
        if any(name.startswith(family) for family in per_adapter) and "adapter" in dict(labels)
    }
    assert seen - {"", "other"} == {"a", "b"}, seen
    assert "other" in seen and "" in seen


@pytest.mark.slow
def test_per_adapter_requests_tokens_and_latency(capped_scrape: Samples) -> None:
    s = capped_scrape
    requests = "loraplex_adapter_requests_total"
    assert value(s, requests, adapter="", code="OK") == 1
    assert value(s, requests, adapter="a", code="OK") == 2
    assert value(s, requests, adapter="b", code="OK") == 2  # one unary, one stream
    # c, d and the Medusa heads came after the cap was full; "nope" is not registered and takes no slot.
    assert value(s, requests, adapter="other", code="OK") == 3
    assert value(s, requests, adapter="other", code="NOT_FOUND") == 1
    assert value(s, requests, adapter="a", code="DEADLINE_EXCEEDED") == 1
    tokens = "loraplex_adapter_generated_tokens_total"
    assert value(s, tokens, adapter="b") == 10 and value(s, tokens, adapter="") == 5
    assert value(s, tokens, adapter="other") == 15
    assert value(s, tokens, adapter="a") >= 10  # plus what the late request generated before its deadline
    ttft = "loraplex_adapter_time_to_first_token_seconds_count"
    assert value(s, ttft, adapter="b") == 2 and value(s, ttft, adapter="other") == 3
    loads = "loraplex_adapter_load_seconds_count"
    assert value(s, loads, adapter="a") == 1 and value(s, loads, adapter="b") == 1
    assert value(s, loads, adapter="other") == 3  # c, d (LoRA) and the Medusa heads


@pytest.mark.slow
def test_demo_adapters_get_their_own_series(tiny_server: Callable[..., BackgroundServer], smollm2_dir: Path) -> None:
    """The image's demo adapters on the real SmolLM2, as the Kubernetes base serves them (--adapter-dir)."""
    demo = ROOT / "adapters" / "demo"
    ids = sorted(p.name for p in demo.iterdir() if p.is_dir())
    assert ids == ["caps", "medusa", "terse"]
    stopping = pb.StoppingCriteria(max_new_tokens=3, ignore_eos=True)
    srv = tiny_server(model=smollm2_dir, metrics_port=0, max_batch_size=2, adapter_dirs=(demo,))
    assert srv.server is not None and srv.server.metrics_port is not None
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for adapter in ids:
            request = pb.GenerateRequest(inputs=[pb.Input(text="Hi")], adapter_id=adapter, stopping=stopping)
            stub.Generate(request, timeout=120)
    port = srv.server.metrics_port

    def counted() -> bool:  # the engine counts a step's tokens after its reply has gone out
        got = scrape(port)
        return all(value(got, "loraplex_adapter_generated_tokens_total", adapter=a) == 3 for a in ids)

    wait_until(counted, timeout=10.0, poll=0.05)
    samples = scrape(port)
    for adapter in ids:
        assert value(samples, "loraplex_adapter_requests_total", adapter=adapter, code="OK") == 1, adapter
        assert value(samples, "loraplex_adapter_generated_tokens_total", adapter=adapter) == 3, adapter
        assert value(samples, "loraplex_adapter_time_to_first_token_seconds_count", adapter=adapter) == 1, adapter
        assert value(samples, "loraplex_adapter_load_seconds_count", adapter=adapter) == 1, adapter
    assert metrics.ADAPTERS.values == tuple(ids)
