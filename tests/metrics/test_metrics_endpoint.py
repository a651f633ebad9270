"""A real Prometheus scrape of /metrics after real traffic: load metrics and request basics are there."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.metrics import scrape, value

from service.api.server import BackgroundServer


def test_metrics_after_traffic(tiny_server: Callable[..., BackgroundServer]) -> None:
    srv = tiny_server(metrics_port=0)
    with grpc.insecure_channel(srv.target) as channel:
        assert srv.server is not None and srv.server.metrics_port
        before = scrape(srv.server.metrics_port)
        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(
            inputs=[pb.Input(text="Hello"), pb.Input(text="World")],
            stopping=pb.StoppingCriteria(max_new_tokens=6, ignore_eos=True),
        )
        stub.Generate(req, timeout=60)
        try:
            stub.Generate(pb.GenerateRequest(inputs=[pb.Input(text="")]), timeout=60)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        after = scrape(srv.server.metrics_port)

    for stage in ("header", "read", "total"):
        assert value(after, "loraplex_model_load_duration_seconds_count", stage=stage, mode="stream") >= 1
    assert value(after, "loraplex_model_load_bytes_total", mode="stream") > 0
    assert value(after, "loraplex_model_loaded") == 1
    assert value(after, "loraplex_model_parameter_bytes") > 0

    def delta(sample: str, **labels: str) -> float:
        try:
            old = value(before, sample, **labels)
        except AssertionError:
            old = 0.0
        return value(after, sample, **labels) - old

    assert delta("loraplex_requests_total", method="Generate", code="OK") == 1
    assert delta("loraplex_requests_total", method="Generate", code="INVALID_ARGUMENT") == 1
    assert delta("loraplex_generated_tokens_total") == 12
    assert delta("loraplex_prompt_tokens_total") >= 2
    assert delta("loraplex_time_to_first_token_seconds_count") == 2
    assert delta("loraplex_request_duration_seconds_count") == 2
    assert delta("loraplex_inter_token_latency_seconds_count") == 10
    assert "process_resident_memory_bytes" in after
