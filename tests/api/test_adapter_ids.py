"""One adapter-id rule on every path: each RPC that takes an id (Generate, GenerateStream, LoadAdapter, UnloadAdapter,
GetAdapter) and the HTTP API's ``model`` answer a malformed id with INVALID_ARGUMENT (HTTP 400, ``param`` the field)
and a well-formed unknown one with NOT_FOUND (HTTP 404); no message echoes more than a short, escaped prefix."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import grpc
import pytest
from loraplex.v1 import adapters_pb2 as apb
from loraplex.v1 import adapters_pb2_grpc as apb_grpc
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from support.adapter_files import write_peft_adapter
from support.http_api import base_url, call
from support.servers import Outcome, as_stream, outcome, text_req

from service.adapters.common.ids import ADAPTER_ID_MAX_CHARS, check_adapter_id, is_adapter_id
from service.api.server import BackgroundServer
from service.errors import ECHO_CHARS, InvalidRequest, echo

MALFORMED = {
    "unicode": "caps\u00e9",
    "control": "ca\x01ps",
    "nul": "ca\x00ps",
    "newline": "caps\n",
    "trailing-space": "caps ",
    "leading-dot": ".caps",
    "slash": "../caps",
    "too-long": "i" * 10_000,
}
UNKNOWN = "ghost-adapter.v2"  # well-formed, never registered
MESSAGE_BOUND = 400  # any refusal here: the fixed text plus at most ECHO_CHARS escaped characters of the id


@pytest.fixture(scope="module")
def server_settings(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("id_root")
    write_peft_adapter(root / "caps", served_tiny_dir, r=2, seed=5)
    return {"http_port": 0, "adapter_dirs": (root,)}


def every_rpc(srv: BackgroundServer, adapter_id: str, *, load: bool = True) -> dict[str, Outcome]:
    """What each RPC taking an adapter id answers for ``adapter_id`` (LoadAdapter only with ``load``)."""
    root = srv.settings.adapter_dirs[0]
    with grpc.insecure_channel(srv.target) as channel:
        gen, admin = pb_grpc.GenerationStub(channel), apb_grpc.AdaptersStub(channel)
        request = text_req("hi", 2, adapter_id=adapter_id)
        outcomes = {
            "Generate": outcome(lambda: gen.Generate(request, timeout=30)),
            "GenerateStream": outcome(lambda: list(gen.GenerateStream(as_stream(request), timeout=30))),
            "UnloadAdapter": outcome(lambda: admin.UnloadAdapter(apb.UnloadAdapterRequest(id=adapter_id), timeout=30)),
            "GetAdapter": outcome(lambda: admin.GetAdapter(apb.GetAdapterRequest(id=adapter_id), timeout=30)),
        }
        if load:
            register = apb.LoadAdapterRequest(id=adapter_id, source=str(root / "caps"))
            outcomes["LoadAdapter"] = outcome(lambda: admin.LoadAdapter(register, timeout=30))
        return outcomes


def every_route(srv: BackgroundServer, model: str) -> dict[str, tuple[int, dict[str, object]]]:
    """What each HTTP route naming a model answers for ``model``: (status, the OpenAI error object)."""
    url = base_url(srv)
    replies = {
        "completions": call(f"{url}/completions", {"model": model, "prompt": "hi", "max_tokens": 2}),
        "chat": call(f"{url}/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]}),
        "models/{id}": call(f"{url}/models/{urllib.parse.quote(model, safe='')}"),
    }
    return {name: (r.status, r.body.get("error", r.body)) for name, r in replies.items()}


def _bounded(details: str, adapter_id: str) -> None:
    assert len(details) < MESSAGE_BOUND, len(details)
    assert all(c.isprintable() and c.isascii() for c in details), repr(details)  # escaped, never raw
    assert adapter_id[: ECHO_CHARS + 1] not in details or len(adapter_id) <= ECHO_CHARS


@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_id_is_invalid_argument_on_every_rpc(server: BackgroundServer, kind: str) -> None:
    bad = MALFORMED[kind]
    for rpc, (code, details) in every_rpc(server, bad).items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (rpc, code, details)
        field = "adapter_id" if rpc.startswith("Generate") else "id"
        assert field in details, (rpc, details)
        _bounded(details, bad)


@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_model_is_400_on_every_http_route(server: BackgroundServer, kind: str) -> None:
    bad = MALFORMED[kind]
    if kind == "too-long":
        bad = bad[:2000]  # a URL path of 10k characters is the HTTP server's own 414 / 400, not ours
    for route, (status, error) in every_route(server, bad).items():
        assert status == 400 and error["param"] == "model", (route, status, error)
        assert error["type"] == "invalid_request_error"
        _bounded(str(error["message"]), bad)


def test_a_well_formed_unknown_id_is_not_found_everywhere(server: BackgroundServer) -> None:
    for rpc, (code, details) in every_rpc(server, UNKNOWN, load=False).items():
        assert code == grpc.StatusCode.NOT_FOUND and f"'{UNKNOWN}' is not registered" in details, (rpc, details)
    for route, (status, error) in every_route(server, UNKNOWN).items():
        assert status == 404 and error["code"] == "model_not_found", (route, status, error)


def test_an_empty_id_is_the_base_model_for_generation_and_invalid_for_the_admin_rpcs(
    server: BackgroundServer,
) -> None:
    outcomes = every_rpc(server, "")
    assert outcomes.pop("Generate")[0] == outcomes.pop("GenerateStream")[0] == grpc.StatusCode.OK
    for rpc, (code, details) in outcomes.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "id is empty" in details, (rpc, code, details)


def test_the_rule_and_the_echo() -> None:
    assert is_adapter_id("a") and is_adapter_id("x" * ADAPTER_ID_MAX_CHARS) and is_adapter_id("My_Adapter-v1.2")
    for bad in MALFORMED.values():
        assert not is_adapter_id(bad)
        with pytest.raises(InvalidRequest) as err:
            check_adapter_id(bad, field="model")
        assert err.value.field == "model"
    assert echo("caps") == "'caps'"
    assert echo("a\x00\u00e9") == "'a\\x00\\xe9'"
    assert echo("z" * 1000) == "'" + "z" * ECHO_CHARS + "'...[" + str(1000 - ECHO_CHARS) + " more characters]"
