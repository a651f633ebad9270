"""Shared helpers for metrics and dashboard tests: in-process samples, scraping /metrics, series names, the
live-traffic scrape, the Grafana dashboard's panels. Test modules import these; none imports another test module."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
import torch
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from service import metrics
from service.adapters.medusa.format import write_medusa
from service.api.server import BackgroundServer
from service.config import Settings
from service.model.config import ModelConfig
from support.adapter_files import write_peft_adapter
from support.paths import ROOT
from support.servers import tiny_settings

DASHBOARD = ROOT / "deploy" / "grafana" / "loraplex.json"

Obj = dict[str, Any]
Families = dict[str, list[tuple[str, dict[str, str], float]]]


def sample(name: str, **labels: str) -> float:
    """A sample of this process's registry (the servers a test starts in-process): 0 before it first exists."""
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def scrape(port: int) -> Families:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    families: Families = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = [(s.name, s.labels, s.value) for s in family.samples]
    return families


def value(families: Families, sample: str, **labels: str) -> float:
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    for name, lab, v in families.get(family, []):
        if name == sample and all(lab.get(k) == x for k, x in labels.items()):
            return v
    raise AssertionError(f"{sample}{labels} not in the scrape")


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


def requests_total(server: BackgroundServer, method: str, code: str) -> float:
    """``loraplex_requests_total{method, code}`` from a real /metrics scrape (0 before the first such call)."""
    assert server.server is not None and server.server.metrics_port
    try:
        return value(scrape(server.server.metrics_port), "loraplex_requests_total", method=method, code=code)
    except AssertionError:
        return 0.0


def series_names(families: Iterable[Metric]) -> set[str]:
    """Every series name these families expose, whether or not a labelled family has children yet."""
    names: set[str] = set()
    for family in families:
        names.update(family.name + suffix for suffix in SERIES_SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def write_live_adapters(root: Path, model_dir: Path) -> Path:
    """``root/lora`` (PEFT LoRA on q/v) and ``root/medusa`` (three Medusa v2 heads, seeded random) for ``model_dir``."""
    write_peft_adapter(root / "lora", model_dir, r=4, alpha=8, seed=3, scale=0.5)
    cfg = ModelConfig.from_hf(model_dir)
    g = torch.Generator().manual_seed(4)
    n_heads, h = 3, cfg.hidden_size
    weight = torch.randn(1, n_heads, h, h, generator=g) * 0.05  # [layers, heads, H, H]
    bias = torch.randn(1, n_heads, h, generator=g) * 0.05  # [layers, heads, H]
    write_medusa(root / "medusa", weight, bias, version=2)
    return root


def live_metrics_settings(model_dir: Path, adapter_dir: Path, **overrides: object) -> Settings:
    """A server with /metrics on a free port and the adapters under ``adapter_dir``; long generations allowed (so a
    client deadline can pass mid-generation)."""
    limits: dict[str, object] = {"max_batch_size": 4, "max_prompt_tokens": 64, "max_new_tokens": 900}
    return tiny_settings(
        model_dir, metrics_port=0, max_total_tokens=1000, adapter_dirs=(adapter_dir,), **{**limits, **overrides}
    )


def speculate_once(stub: pb_grpc.GenerationStub) -> pb.GenerateResponse:
    """A greedy 16-token generation with the Medusa heads of ``write_live_adapters``: drafts proposed and verified."""
    request = pb.GenerateRequest(
        inputs=[pb.Input(text="Speculate")],
        adapter_id="medusa",
        speculate=True,
        stopping=pb.StoppingCriteria(max_new_tokens=16, ignore_eos=True),
    )
    return stub.Generate(request, timeout=60)


def scrape_live_server(model_dir: Path, adapter_dir: Path) -> str:
    """Start a server on free ports with the adapters under ``adapter_dir`` (see ``write_live_adapters``), send
    base-model, LoRA (cold, then warm) and speculative (Medusa, greedy) traffic, return its /metrics text."""
    settings = live_metrics_settings(model_dir, adapter_dir)
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
            for text in ("Cold adapter", "Warm adapter"):  # the first request loads the LoRA, the second hits
                lora = stub.Generate(
                    pb.GenerateRequest(inputs=[pb.Input(text=text)], adapter_id="lora", stopping=stopping),
                    timeout=60,
                )
                assert lora.results[0].usage.generated_tokens == 6
            assert speculate_once(stub).results[0].usage.generated_tokens == 16
            for _ in range(2):  # a constrained request compiles (a miss), then hits the grammar cache
                constrained = pb.GenerateRequest(
                    inputs=[pb.Input(text="Digits")], stopping=stopping, constraint=pb.Constraint(regex="[0-9]{4,9}")
                )
                assert stub.Generate(constrained, timeout=60).results[0].text.isdigit()
        url = f"http://{settings.metrics_host}:{srv.server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            body: str = response.read().decode()
    return body


def load_dashboard() -> Obj:
    dashboard: Obj = json.loads(DASHBOARD.read_text())
    return dashboard


def panels(dashboard: Obj) -> list[Obj]:
    """Every non-row panel, including those nested in collapsed rows."""
    out: list[Obj] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out += panel.get("panels", [])
        else:
            out.append(panel)
    return out
