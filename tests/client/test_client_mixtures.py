"""The client's ``adapter_scale`` / ``adapters`` keywords (``loraplex._mixture``): they land in both requests'
fields, the routing header names the first adapter, and what the client can see is wrong is refused before any
RPC. A live call checks the server receives the mixture as sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from loraplex import Client, WeightedAdapter, _convert
from loraplex.v1 import generation_pb2 as pb
from support.adapter_files import write_peft_adapter
from support.servers import tiny_settings

from service.api.server import BackgroundServer
from service.engine.request import GenerationRequest


def _requests(**kwargs: Any) -> tuple[_convert.GenerationOptions, pb.GenerateRequest, pb.GenerateStreamRequest]:
    opts = _convert.generation_options(**kwargs)
    unary = _convert.generate_request([pb.Input(text="hi")], opts)
    stream = _convert.stream_request(pb.Input(text="hi"), opts)
    assert list(unary.adapters) == list(stream.adapters)
    assert unary.HasField("adapter_scale") == stream.HasField("adapter_scale")
    return opts, unary, stream


def test_scale_and_mixtures_land_in_both_requests() -> None:
    opts, unary, _ = _requests(adapter="a", adapter_scale=0.5)
    assert (opts.adapter_id, unary.adapter_id, unary.adapter_scale, list(unary.adapters)) == ("a", "a", 0.5, [])
    opts, unary, _ = _requests(adapters=[("b", 0.5), WeightedAdapter("a", -1)])
    assert opts.adapter_id == unary.adapter_id == "b"  # the routing header and the message name the first
    assert list(unary.adapters) == [pb.WeightedAdapter(id="b", weight=0.5), pb.WeightedAdapter(id="a", weight=-1)]
    assert not unary.HasField("adapter_scale")
    opts, unary, _ = _requests(adapter="a")
    assert not unary.HasField("adapter_scale") and not unary.adapters


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"adapter_scale": 0.5}, ValueError, "needs an adapter"),
        ({"adapter": "a", "adapter_scale": float("nan")}, ValueError, "finite"),
        ({"adapter": "a", "adapter_scale": "1"}, TypeError, "number"),
        ({"adapters": [("a", 1), ("a", 2)]}, ValueError, "repeats"),
        ({"adapters": [("a", 0)]}, ValueError, "weight is 0"),
        ({"adapters": [("a", float("inf"))]}, ValueError, "finite"),
        ({"adapters": ["a"]}, TypeError, "pair"),
        ({"adapters": "a"}, TypeError, "list"),
        ({"adapter": "b", "adapters": [("a", 1)]}, ValueError, "first of adapters"),
        ({"adapter": "a", "adapter_scale": 2, "adapters": [("a", 1)]}, ValueError, "exclude each other"),
    ],
)
def test_what_the_client_can_see_is_refused_before_any_rpc(
    kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        _convert.generation_options(**kwargs)


def test_the_server_receives_the_mixture(
    served_tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support.tiny_models import load_hf_llama

    base = load_hf_llama(served_tiny_dir)
    adapters = tuple((n, write_peft_adapter(tmp_path / n, base, r=2, seed=i)) for i, n in enumerate("ab", 1))
    with BackgroundServer(tiny_settings(served_tiny_dir, adapters=adapters)) as srv:
        engine = srv.server.runtime.loaded.engine  # type: ignore[union-attr]
        seen: list[GenerationRequest] = []
        real = engine.submit
        monkeypatch.setattr(engine, "submit", lambda r, sink: (seen.append(r), real(r, sink))[1])
        with Client(srv.target) as client:
            plain = client.generate("hi", adapter="a", max_new_tokens=4, return_token_ids=True)
            scaled = client.generate("hi", adapter="a", adapter_scale=1.0, max_new_tokens=4, return_token_ids=True)
            assert scaled.token_ids == plain.token_ids
            list(client.stream("hi", adapters=[("b", 0.5), ("a", 0.5)], max_new_tokens=2))
    assert [(r.adapter_id, r.mix) for r in seen] == [("a", ()), ("a", ()), ("b", (("b", 0.5), ("a", 0.5)))]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mix", "a"], "expected ID=WEIGHT"),
        (["--mix", "a=x"], "expected ID=WEIGHT"),
        (["--adapter-scale", "0.5"], "adapter_scale needs an adapter"),
        (["--mix", "a=1", "--mix", "a=2"], "repeats adapter"),
        (["--adapter", "a", "--adapter-scale", "2", "--mix", "a=1"], "exclude each other"),
    ],
)
def test_cli_mixture_flags_are_refused_before_any_rpc(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    try:  # port 1 on loopback: nothing listens, so a request that got as far as an RPC would fail differently
        code = main(["generate", "--target", "127.0.0.1:1", "--timeout", "5", *flags, "hi"])
    except SystemExit as exit:  # argparse's own refusals
        code = exit.code  # type: ignore[assignment]
    assert code == 2
    assert message in capsys.readouterr().err
