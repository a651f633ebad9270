"""Per-request adapter strength (``adapter_scale``) and weighted mixtures (``adapters``) over real gRPC and HTTP.

One server on loopback serves both APIs with three LoRAs. Every bad input of docs/bad-inputs.md's mixture rows
gets its status (gRPC) and HTTP status with ``param``, and the server keeps serving: the plain adapter's greedy
tokens are the same after each. A scale of 1 is the plain request token for token (and reaches the engine as the
plain request: ``mix`` empty); a valid mixture reaches the engine with its ``mix`` in request order. The numerics
of a mixture against PEFT are the batched math's tests, not these.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.adapter_files import write_peft_adapter
from support.http_api import Reply, base_url, call
from support.servers import as_stream, outcome, text_req, tiny_settings

from service.api.server import BackgroundServer
from service.engine.request import GenerationRequest

W = pb.WeightedAdapter


@pytest.fixture(scope="module")
def live(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    from support.tiny_models import load_hf_llama

    base = load_hf_llama(served_tiny_dir)
    root = tmp_path_factory.mktemp("mixtures")
    kinds: dict[str, dict[str, Any]] = {"d": {"use_dora": True}, "e": {"modules_to_save": ["norm"]}}
    adapters = tuple(
        (name, write_peft_adapter(root / name, base, r=4, seed=seed, scale=0.5, **kinds.get(name, {})))
        for seed, name in enumerate(("a", "b", "c", "d", "e"), start=1)
    )
    settings = tiny_settings(served_tiny_dir, adapters=adapters, http_port=0, max_mixture_adapters=3)
    with BackgroundServer(settings) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(live: BackgroundServer) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(live.target) as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture
def submitted(live: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> list[GenerationRequest]:
    """Every request the engine queued from here on (its own ``submit`` runs, and refuses before queueing)."""
    engine = live.server.runtime.loaded.engine  # type: ignore[union-attr]
    seen: list[GenerationRequest] = []
    real = engine.submit

    def spy(request: GenerationRequest, sink: Any) -> Any:
        handle = real(request, sink)
        seen.append(request)
        return handle

    monkeypatch.setattr(engine, "submit", spy)
    return seen


def tokens(stub: pb_grpc.GenerationStub, **kw: Any) -> list[int]:
    return list(stub.Generate(text_req("Once upon a time", 8, **kw), timeout=60).results[0].token_ids)


def http(live: BackgroundServer, body: dict[str, Any]) -> Reply:
    prompt = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    return call(f"{base_url(live)}/completions", {**prompt, **body})


def both(stub: pb_grpc.GenerationStub, **kw: Any) -> list[tuple[grpc.StatusCode, str]]:
    r = text_req("fine prompt", 4, **kw)
    stream = as_stream(r)
    if r.HasField("adapter_scale"):
        stream.adapter_scale = r.adapter_scale
    stream.adapters.extend(r.adapters)
    return [
        outcome(lambda: stub.Generate(r, timeout=30)),
        outcome(lambda: list(stub.GenerateStream(stream, timeout=30))),
    ]


# case -> (gRPC fields, HTTP body fields, gRPC status, HTTP status, HTTP param, message fragment)
BAD: dict[str, tuple[dict[str, Any], dict[str, Any], grpc.StatusCode, int, str, str]] = {
    "mix-too-many": (
        {"adapters": [W(id=n, weight=0.5) for n in "abcd"]},
        {"model": "a", "adapters": [{"id": n, "weight": 0.5} for n in "abcd"]},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapters", "--max-mixture-adapters",
    ),
    "mix-weight-nan": (
        {"adapters": [W(id="a", weight=0.5), W(id="b", weight=float("nan"))]},
        {"model": "a", "adapters": [{"id": "a", "weight": 0.5}, {"id": "b", "weight": float("nan")}]},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapters[1].weight", "adapters[1].weight must be a finite number",
    ),
    "mix-weight-inf": (
        {"adapters": [W(id="a", weight=float("inf")), W(id="b", weight=1.0)]},
        {"model": "a", "adapters": [{"id": "a", "weight": 1e39}, {"id": "b", "weight": 1.0}]},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapters[0].weight", "adapters[0].weight must be a finite number",
    ),
    "mix-weight-over": (
        {"adapters": [W(id="a", weight=0.5), W(id="b", weight=-8.5)]},
        {"model": "a", "adapters": [{"id": "a", "weight": 0.5}, {"id": "b", "weight": -8.5}]},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapters[1].weight", "in [-8, 8]",
    ),
    "mix-weight-zero": (
        {"adapters": [W(id="a", weight=0.5), W(id="b")]},
        {"model": "a", "adapters": [{"id": "a", "weight": 0.5}, {"id": "b", "weight": 0}]},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapters[1].weight", "is 0 (unset?)",
    ),
    "mix-duplicate": (
        {"adapters": [W(id="a", weight=0.5), W(id="a", weight=0.5)]},
        {"model": "a", "adapters": [{"id": "a", "weight": 0.5}, {"id": "a", "weight": 0.5}]},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapters[1].id", "repeats an adapter",
    ),
    "mix-unknown": (
        {"adapters": [W(id="a", weight=0.5), W(id="ghost", weight=0.5)]},
        {"model": "a", "adapters": [{"id": "a", "weight": 0.5}, {"id": "ghost", "weight": 0.5}]},
        grpc.StatusCode.NOT_FOUND, 404, "adapters", "ghost",
    ),
    "mix-bad-id": (
        {"adapters": [W(id="a", weight=0.5), W(id="b c", weight=0.5)]},
        {"model": "a", "adapters": [{"id": "a", "weight": 0.5}, {"id": "b c", "weight": 0.5}]},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapters[1].id", "invalid adapter id",
    ),
    "mix-first-differs": (
        {"adapter_id": "c", "adapters": [W(id="a", weight=0.5), W(id="b", weight=0.5)]},
        {"model": "c", "adapters": [{"id": "a", "weight": 0.5}, {"id": "b", "weight": 0.5}]},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "model", "is not adapters[0].id",
    ),
    "mix-with-scale": (
        {"adapter_id": "a", "adapter_scale": 0.5, "adapters": [W(id="a", weight=0.5)]},
        {"model": "a", "adapter_scale": 0.5, "adapters": [{"id": "a", "weight": 0.5}]},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapter_scale", "exclude each other",
    ),
    "scale-no-adapter": (
        {"adapter_scale": 0.5}, {"adapter_scale": 0.5},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapter_scale", "needs an adapter",
    ),
    "scale-nan": (
        {"adapter_id": "a", "adapter_scale": float("nan")}, {"model": "a", "adapter_scale": float("nan")},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapter_scale", "adapter_scale must be a finite number",
    ),
    "scale-over": (
        {"adapter_id": "a", "adapter_scale": 9.0}, {"model": "a", "adapter_scale": 9.0},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapter_scale", "in [-8, 8]",
    ),
    "mix-dora": (
        {"adapters": [W(id="a", weight=0.5), W(id="d", weight=0.5)]},
        {"model": "a", "adapters": [{"id": "a", "weight": 0.5}, {"id": "d", "weight": 0.5}]},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapters[1].id", "DoRA",
    ),
    "mix-modules-to-save": (
        {"adapters": [W(id="e", weight=0.5), W(id="a", weight=0.5)]},
        {"model": "e", "adapters": [{"id": "e", "weight": 0.5}, {"id": "a", "weight": 0.5}]},
        grpc.StatusCode.INVALID_ARGUMENT, 400, "adapters[0].id", "modules_to_save",
    ),
}  # fmt: skip


def test_the_dora_and_saved_adapters_are_what_the_refusals_say(stub: pb_grpc.GenerationStub, live: Any) -> None:
    """ "d" is a real DoRA adapter and "e" a real modules_to_save one, as ListAdapters reports them; each serves alone
    (at a scale too)."""
    from loraplex.v1 import adapters_pb2 as apb
    from loraplex.v1 import adapters_pb2_grpc as apb_grpc

    with grpc.insecure_channel(live.target) as channel:
        shown = {a.id: a for a in apb_grpc.AdaptersStub(channel).ListAdapters(apb.ListAdaptersRequest()).adapters}
    assert shown["d"].dora and not shown["d"].saved_modules
    assert list(shown["e"].saved_modules) == ["input_layernorm", "post_attention_layernorm", "norm"]
    assert not shown["e"].dora and not shown["a"].saved_modules
    for adapter in ("d", "e"):
        assert len(tokens(stub, adapter_id=adapter)) == 8
        assert len(tokens(stub, adapter_id=adapter, adapter_scale=0.5)) == 8


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_mixtures_are_refused_on_both_apis_and_the_server_keeps_serving(
    case: str,
    live: BackgroundServer,
    stub: pb_grpc.GenerationStub,
    submitted: list[GenerationRequest],
) -> None:
    fields, body, code, status, param, fragment = BAD[case]
    before = tokens(stub, adapter_id="a")
    submitted.clear()
    for got, details in both(stub, **fields):
        assert got == code, (case, got, details)
        assert fragment.lower() in details.lower(), (case, details)
    reply = http(live, {"model": live.server.runtime.settings.model.resolve().name, **body})  # type: ignore[union-attr]
    assert reply.status == status, (case, reply.body)
    assert reply.body["error"]["param"] == param, (case, reply.body)
    assert not submitted, "a refused request reached the engine"
    assert tokens(stub, adapter_id="a") == before


def test_a_scale_of_one_is_the_plain_adapter_request(
    stub: pb_grpc.GenerationStub, live: BackgroundServer, submitted: list[GenerationRequest]
) -> None:
    plain = tokens(stub, adapter_id="a")
    assert tokens(stub, adapter_id="a", adapter_scale=1.0) == plain
    assert tokens(stub, adapters=[W(id="a", weight=1.0)]) == plain
    assert [(r.adapter_id, r.mix) for r in submitted] == [("a", ())] * 3  # normalised: today's K/V key
    http_plain = http(live, {"model": "a"})
    assert http(live, {"model": "a", "adapter_scale": 1.0}).body["choices"] == http_plain.body["choices"]


def test_a_mixture_reaches_the_engine_in_request_order(
    stub: pb_grpc.GenerationStub, live: BackgroundServer, submitted: list[GenerationRequest]
) -> None:
    stub.Generate(text_req("hi", 2, adapters=[W(id="b", weight=0.5), W(id="a", weight=-0.25)]), timeout=60)
    list(stub.GenerateStream(as_stream(text_req("hi", 2, adapter_id="c")), timeout=60))
    stream = as_stream(text_req("hi", 2, adapter_id="c"))
    stream.adapter_scale = 0.75
    list(stub.GenerateStream(stream, timeout=60))
    base = live.server.runtime.settings.model.resolve().name  # type: ignore[union-attr]
    reply = http(live, {"model": base, "adapters": [{"id": "c", "weight": 2}, {"id": "b", "weight": 0.5}]})
    assert reply.status == 200, reply.body
    assert [(r.adapter_id, r.mix, r.deltas_key) for r in submitted] == [
        ("b", (("b", 0.5), ("a", -0.25)), (("b", 0.5), ("a", -0.25))),
        ("c", (), (("c", 1.0),)),
        ("c", (("c", 0.75),), (("c", 0.75),)),
        ("c", (("c", 2.0), ("b", 0.5)), (("c", 2.0), ("b", 0.5))),
    ]


def test_a_mixture_holds_every_component_and_keys_its_kv_by_weights(live: BackgroundServer) -> None:
    catalog = live.server.runtime.loaded.adapters  # type: ignore[union-attr]
    plain = catalog.resolve("a")
    assert catalog.resolve_mix([("a", 1.0)], limit=3).kv_key() == plain.kv_key()
    scaled = catalog.resolve_mix([("a", 0.5)], limit=3)
    mixed = catalog.resolve_mix([("a", 0.5), ("b", 0.5)], limit=3)
    swapped = catalog.resolve_mix([("b", 0.5), ("a", 0.5)], limit=3)
    keys = {plain.kv_key(), scaled.kv_key(), mixed.kv_key(), swapped.kv_key()}
    assert len(keys) == 4  # no two scales or mixtures share K/V
    assert mixed.components == ("a", "b") and mixed.id == "a"
    assert mixed.kv_key() == ((plain.kv_key(), 0.5), (catalog.resolve("b").kv_key(), 0.5))
    mixed.load()
    try:
        from support.wait import wait_until

        assert wait_until(mixed.ready)
        assert mixed.binding().deltas
    finally:
        mixed.release()
