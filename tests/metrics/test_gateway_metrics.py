"""The inference gateway's model-server protocol metrics, scraped over real HTTP while adapters run and wait.

``LoraRequestsInfo`` is walked on its own first (one series at a time, ids in first-seen order), then through a
stepped engine (one slot, two adapters: the label set after every step follows the rows). Then a real server
(tiny random Llama, ``--max-batch-size 1``, two LoRA adapters) runs a long stream on adapter ``a`` (over gRPC)
while an OpenAI completion for ``b`` queues behind it: the scrape's ``loraplex_lora_requests_info`` names ``a``
running, ``b`` waiting and ``max_lora="1"``, its value is the current Unix time, and the queue / running / KV
gauges the endpoint picker reads are gauges within their ranges. When both are done the single series names no
adapter.
"""

from __future__ import annotations

import shutil
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from prometheus_client import Gauge
from prometheus_client.parser import text_string_to_metric_families
from support.adapter_files import write_peft_adapter
from support.engines import Events, idle, prompt, req, step_until
from support.http_api import base_url, call
from support.metrics import write_live_adapters
from support.wait import wait_until

from service import metrics
from service.adapters.catalog import AdapterCatalog
from service.adapters.lora.part import LoraPart
from service.adapters.lora.store import AdapterStore
from service.api.server import BackgroundServer
from service.config import Settings
from service.engine.engine import Engine
from service.metrics import LoraRequestsInfo
from service.model.load_folder import load_model
from service.tokenizer import Tokenizer

INFO = "loraplex_lora_requests_info"
# The protocol's gauges as loraplex names them (docs/operations.md, "Inference gateway (endpoint picker)").
PROTOCOL_GAUGES = (INFO, "loraplex_waiting_requests", "loraplex_running_requests", "loraplex_kv_cache_usage_ratio")


def test_one_series_at_a_time() -> None:
    gauge = Gauge(INFO, "test", ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=None)
    info = LoraRequestsInfo(gauge)
    began = time.time()

    def info_series() -> list[tuple[dict[str, str], float]]:
        return [(s.labels, s.value) for f in gauge.collect() for s in f.samples]

    info.publish(["a", "b", "a"], ["c"], 4)
    assert info.labels == ("a,b", "c", "4")
    info.publish(["a", "b"], ["c", "c"], 4)  # the same label set: the series is refreshed, not duplicated
    info.publish([], ["b"], 4)
    assert info.labels == ("", "b", "4")
    assert [labels for labels, _ in info_series()] == [
        {"running_lora_adapters": "", "waiting_lora_adapters": "b", "max_lora": "4"}
    ]
    assert began <= info_series()[0][1] <= time.time()  # the value is the Unix time of the last publish


def lora_engine(folder: Path, root: Path) -> Engine:
    """A stepped engine with one slot and the LoRA adapters ``a`` and ``b`` resident before the first step."""
    settings = Settings(model=folder, max_batch_size=1, max_total_tokens=128, max_prompt_tokens=32)
    model, cfg, _ = load_model(folder, dtype=torch.float32, device=torch.device("cpu"))
    store = AdapterStore(
        cfg, device=torch.device("cpu"), dtype=torch.float32, device_budget_bytes=1 << 24, host_budget_bytes=1 << 24
    )
    catalog = AdapterCatalog([LoraPart(store)])
    for name in ("a", "b"):
        catalog.register(name, root / name)
        store.ensure(name, timeout=30)
    return Engine(model, Tokenizer.from_folder(folder), settings, adapters=catalog)


def test_engine_publishes_the_rows_adapters_each_step(served_tiny_dir: Path, tmp_path: Path) -> None:
    for name, seed in (("a", 3), ("b", 4)):
        write_peft_adapter(tmp_path / name, served_tiny_dir, r=4, alpha=8, seed=seed, scale=0.5)
    engine = lora_engine(served_tiny_dir, tmp_path)
    events = Events()
    events.submit(engine, req("base", prompt(0, 4), 2))
    events.submit(engine, req("ra", prompt(1, 4), 3, adapter_id="a"))
    events.submit(engine, req("rb", prompt(2, 4), 3, adapter_id="b"))
    engine.step()
    assert metrics.LORA_INFO.labels == ("", "a,b", "1")  # the base model's row runs; it names no adapter
    step_until(engine, lambda: events.finished("base") and engine.state().running == 1)
    assert metrics.LORA_INFO.labels == ("a", "b", "1")
    step_until(engine, lambda: events.finished("ra") and engine.state().running == 1)
    assert metrics.LORA_INFO.labels == ("b", "", "1")
    step_until(engine, lambda: idle(engine))
    assert metrics.LORA_INFO.labels == ("", "", "1")


def scrape(port: int) -> tuple[dict[str, str], dict[str, list[tuple[dict[str, str], float]]]]:
    """(family name -> its ``# TYPE``, family name -> its samples) of one /metrics scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    samples = {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}
    return types, samples


def stream(stub: pb_grpc.GenerationStub, adapter: str, n: int) -> grpc.Future:
    req = pb.GenerateStreamRequest(
        input=pb.Input(text="Go"), adapter_id=adapter, stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True)
    )
    return stub.GenerateStream(req, timeout=120)


@pytest.mark.slow
def test_lora_info_names_running_and_queued_adapters(
    tiny_server: Callable[..., BackgroundServer], served_tiny_dir: Path, tmp_path: Path
) -> None:
    root = write_live_adapters(tmp_path, served_tiny_dir)
    for name in ("a", "b"):
        shutil.copytree(root / "lora", root / name)
    limits = {"max_prompt_tokens": 64, "max_new_tokens": 900, "max_total_tokens": 1000}
    srv = tiny_server(limits, metrics_port=0, http_port=0, adapter_dirs=(root,), max_batch_size=1)
    assert srv.server is not None and srv.server.metrics_port is not None
    port = srv.server.metrics_port
    began = time.time()
    with grpc.insecure_channel(srv.target) as channel, ThreadPoolExecutor(1) as pool:
        stub = pb_grpc.GenerationStub(channel)
        long = stream(stub, "a", 900)
        next(long)  # a's row is running
        # The second arrives as the gateway sends it: an OpenAI completion whose ``model`` is the adapter id.
        queued = pool.submit(call, f"{base_url(srv)}/completions", {"model": "b", "prompt": "Go", "max_tokens": 2})
        running_and_waiting = {"running_lora_adapters": "a", "waiting_lora_adapters": "b", "max_lora": "1"}
        seen: list[tuple[dict[str, str], dict[str, list[tuple[dict[str, str], float]]]]] = []

        def both_shown() -> bool:
            seen.append(scrape(port))
            return [labels for labels, _ in seen[-1][1][INFO]] == [running_and_waiting]

        assert wait_until(both_shown, timeout=30, poll=0.02), seen[-1][1].get(INFO)
        types, samples = seen[-1]
        assert all(types[name] == "gauge" for name in PROTOCOL_GAUGES), types
        assert began <= samples[INFO][0][1] <= time.time()  # the Unix time of an engine step of this call
        assert samples["loraplex_running_requests"][0][1] == 1
        assert samples["loraplex_waiting_requests"][0][1] == 1
        assert 0 <= samples["loraplex_kv_cache_usage_ratio"][0][1] <= 1
        long.cancel()
        assert queued.result(timeout=60).status == 200  # b ran once a's slot was free

        def idle() -> bool:
            seen.append(scrape(port))
            return [labels for labels, _ in seen[-1][1][INFO]] == [
                {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "1"}
            ]

        assert wait_until(idle, timeout=30, poll=0.02), seen[-1][1].get(INFO)
