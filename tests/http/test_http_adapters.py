"""vLLM's adapter routes on the HTTP API: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

A client written for vLLM (plain ``http.client`` calls, shaped as vLLM documents them) loads an adapter, generates
with it, finds it in ``/v1/models`` and unloads it; the routes need the admin role; and every LoadAdapter /
UnloadAdapter row of docs/bad-inputs.md holds over HTTP too (the same refusal, as an HTTP status).
"""

from __future__ import annotations

import http.client
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from loraplex.v1 import adapters_pb2 as apb
from loraplex.v1 import adapters_pb2_grpc as apb_grpc
from support.adapter_files import write_peft_adapter
from support.http_api import Reply, base_url, call, requests_count
from support.paths import ROOT

from service.adapters.lora.part import LoraPart
from service.adapters.lora.store import AdapterStore
from service.api.http.errors import HTTP_STATUS
from service.api.server import BackgroundServer

GENERATE_KEY, ADMIN_KEY = "gen-http-7a", "adm-http-3c"
DOC = ROOT / "docs" / "bad-inputs.md"


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory, served_tiny_dir: Path) -> tuple[Path, Path]:
    """The adapter root (with ``sql``, ``other`` and a plain file) and a folder outside it."""
    root, outside = tmp_path_factory.mktemp("http_load_root"), tmp_path_factory.mktemp("http_load_outside")
    write_peft_adapter(root / "sql", served_tiny_dir, r=4, seed=21, scale=2.0)
    write_peft_adapter(root / "other", served_tiny_dir, r=4, seed=22, scale=2.0)
    write_peft_adapter(outside / "healthy", served_tiny_dir, r=2, seed=23, scale=2.0)
    (root / "plain.txt").write_text("not an adapter folder")
    return root, outside


@pytest.fixture(scope="module")
def server_settings(roots: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    keys = tmp_path_factory.mktemp("http_load_keys") / "keys"
    keys.write_text(f"generate:{GENERATE_KEY}\nadmin:{ADMIN_KEY}\n")
    return {"http_port": 0, "adapter_roots": (roots[0],), "api_key_file": keys, "max_new_tokens": 64}


def _vllm_call(server: BackgroundServer, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, str]:
    """One request as a script written for vLLM sends it: ``http.client``, a JSON body, the key as a Bearer."""
    assert server.server is not None and server.server.http is not None
    connection = http.client.HTTPConnection("127.0.0.1", server.server.http.port, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"}
    try:
        connection.request(method, path, None if body is None else json.dumps(body), headers)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def test_a_client_written_for_vllm_loads_generates_lists_and_unloads(
    server: BackgroundServer, roots: tuple[Path, Path], served_tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base, path = served_tiny_dir.resolve().name, str(roots[0] / "sql")
    loads = requests_count("http.load_lora_adapter", "OK")
    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        status, text = _vllm_call(server, "POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": path})
    assert (status, text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    assert requests_count("http.load_lora_adapter", "OK") == loads + 1
    lines = [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "event=access"]
    line = next(f for f in lines if f["method"] == "http.load_lora_adapter")
    assert (line["adapter"], line["code"]) == ("sql", "OK")

    status, text = _vllm_call(server, "GET", "/v1/models", None)
    cards = {card["id"]: card for card in json.loads(text)["data"]}
    assert status == 200 and cards[base]["root"] == base and "parent" not in cards[base]
    assert (cards["sql"]["parent"], cards["sql"]["root"], cards["sql"]["object"]) == (base, path, "model")
    card = {"kind": "lora", "dora": False, "saved_modules": [], "tier": "disk"}
    assert cards["sql"]["loraplex"] == card  # registered, not loaded
    assert "loraplex" not in cards[base]

    def complete(model: str) -> tuple[int, dict[str, Any]]:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        status, text = _vllm_call(server, "POST", "/v1/completions", body)
        return status, json.loads(text)

    (status, tuned), (_, plain) = complete("sql"), complete(base)
    assert status == 200 and tuned["model"] == "sql", tuned
    assert tuned["choices"][0]["text"] != plain["choices"][0]["text"]  # the adapter is applied

    status, text = _vllm_call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert (status, text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    status, text = _vllm_call(server, "GET", "/v1/models", None)
    assert "sql" not in {card["id"] for card in json.loads(text)["data"]}
    assert complete("sql")[0] == 404
    status, text = _vllm_call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 404 and "is not registered" in json.loads(text)["error"]["message"]


def test_the_adapter_routes_need_the_admin_role(server: BackgroundServer, roots: tuple[Path, Path]) -> None:
    url = base_url(server)
    body = {"lora_name": "other", "lora_path": str(roots[0] / "other")}
    for route, payload in (("/load_lora_adapter", body), ("/unload_lora_adapter", {"lora_name": "other"})):
        for key, status, kind in ((None, 401, "authentication_error"), ("wrong", 401, "authentication_error"),
                                  (GENERATE_KEY, 403, "permission_error")):  # fmt: skip
            counted = ("http" + route.replace("/", "."), "UNAUTHENTICATED" if status == 401 else "PERMISSION_DENIED")
            before = requests_count(*counted)
            reply = call(url + route, payload, key=key)
            assert (reply.status, reply.body["error"]["type"]) == (status, kind), (route, key, reply.body)
            assert requests_count(*counted) == before + 1
        assert "needs an admin API key" in call(url + route, payload, key=GENERATE_KEY).body["error"]["message"]
    assert call(url + "/models", key=GENERATE_KEY).status == 200  # the generate role still lists
    assert "other" not in [c["id"] for c in call(url + "/models", key=ADMIN_KEY).body["data"]]  # nothing loaded


# ------------------------------------------------------------------------------------------ the doc's rows

Body = Callable[[Path, Path], dict[str, Any]]


def _load(name: str, where: Callable[[Path, Path], str]) -> tuple[str, Body]:
    return "/load_lora_adapter", lambda root, outside: {"lora_name": name, "lora_path": where(root, outside)}


def _unload(name: str) -> tuple[str, Body]:
    return "/unload_lora_adapter", lambda root, outside: {"lora_name": name}


def _in_root(root: Path, outside: Path) -> str:
    return str(root / "other")


HTTP_CASES: dict[str, tuple[str, Body]] = {
    "load-missing-folder": _load("missing", lambda root, outside: str(root / "absent")),
    "load-outside-roots": _load("outside", lambda root, outside: str(outside / "healthy")),
    "load-plain-file": _load("plain", lambda root, outside: str(root / "plain.txt")),
    "load-empty-source": _load("empty", lambda root, outside: ""),
    "load-hf-malformed": _load("hf-bad", lambda root, outside: "hf://acme/../etc"),
    "load-hf-absent": _load("hf-absent", lambda root, outside: "hf://acme/loraplex-not-in-any-cache"),
    "load-bad-id": _load("bad id", _in_root),
    "load-id-too-long": _load("i" * 10_000, _in_root),
    "load-empty-id": _load("", _in_root),
    "load-duplicate": _load("resident", _in_root),
    "unload-unknown": _unload("ghost"),
    "unload-id-too-long": _unload("u" * 10_000),
    "unload-bad-id": _unload("good "),
    "unload-empty-id": _unload(""),
}
"""Each LoadAdapter / UnloadAdapter row of docs/bad-inputs.md as vLLM's body (``id`` -> ``lora_name``, ``source``
-> ``lora_path``); ``resident`` is registered before the rows run."""


def _grpc_rows() -> dict[str, tuple[str, str]]:
    """``case -> (gRPC status, message fragment)`` of the doc's LoadAdapter / UnloadAdapter rows."""
    text = DOC.read_text().split("## Walked against one live server", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        if line.startswith("| `") and cells[2] in ("LoadAdapter", "UnloadAdapter"):
            rows[cells[0].strip("`")] = (cells[3], cells[4].strip("`"))
    return rows


def _http_status(grpc_status: str) -> int:
    return 400 if grpc_status == "ALREADY_EXISTS" else HTTP_STATUS[grpc_status]  # vLLM: already loaded is 400


def _http_fragment(fragment: str) -> str:
    """The message fragment with vLLM's field names: ``id is empty`` -> ``lora_name is empty``."""
    for grpc_field, http_field in (("id ", "lora_name "), ("source ", "lora_path ")):
        if fragment.startswith(grpc_field):
            return http_field + fragment.removeprefix(grpc_field)
    return fragment


def test_every_load_and_unload_row_of_the_doc_has_an_http_case() -> None:
    assert set(_grpc_rows()) == set(HTTP_CASES)


@pytest.mark.parametrize("case", sorted(HTTP_CASES))
def test_the_grpc_bad_inputs_of_load_and_unload_hold_over_http(
    server: BackgroundServer, roots: tuple[Path, Path], case: str
) -> None:
    root, outside = roots
    url = base_url(server)
    if "resident" not in [c["id"] for c in call(url + "/models", key=ADMIN_KEY).body["data"]]:
        loaded = call(url + "/load_lora_adapter", {"lora_name": "resident", "lora_path": _in_root(root, outside)},
                      key=ADMIN_KEY)  # fmt: skip
        assert loaded.status == 200, loaded.body
    status, fragment = _grpc_rows()[case]
    route, body = HTTP_CASES[case]
    reply = call(url + route, body(root, outside), key=ADMIN_KEY)
    assert reply.status == _http_status(status), (case, reply.body)
    message = reply.body["error"]["message"]
    assert _http_fragment(fragment).lower() in message.lower(), (case, message)
    assert len(message) < 4096
    assert reply.body["error"]["type"] in ("invalid_request_error", "permission_error")


def _refused(server: BackgroundServer, route: str, body: object) -> Reply:
    reply = call(base_url(server) + route, body if isinstance(body, bytes) else json.dumps(body).encode(),
                 key=ADMIN_KEY)  # fmt: skip
    assert reply.status == 400, reply.body
    return reply


def test_bodies_vllm_would_refuse_are_400(server: BackgroundServer) -> None:
    for route in ("/load_lora_adapter", "/unload_lora_adapter"):
        assert "not valid JSON" in _refused(server, route, b"{").body["error"]["message"]
        assert "JSON object" in _refused(server, route, ["lora_name"]).body["error"]["message"]
        wrong = _refused(server, route, {"lora_name": 7, "lora_path": "x"}).body["error"]
        assert (wrong["param"], wrong["message"]) == ("lora_name", "lora_name must be a string, not int")
        assert "lora_name is empty" in _refused(server, route, {}).body["error"]["message"]
    missing = _refused(server, "/load_lora_adapter", {"lora_name": "nopath"}).body["error"]
    assert "lora_path is empty" in missing["message"] and missing["param"] == "lora_path"


def test_grpc_and_http_share_one_catalog(server: BackgroundServer, roots: tuple[Path, Path]) -> None:
    folder = shutil.copytree(roots[0] / "other", roots[0] / "shared")
    with grpc.insecure_channel(server.target) as channel:
        admin = apb_grpc.AdaptersStub(channel)
        md = (("authorization", f"Bearer {ADMIN_KEY}"),)
        admin.LoadAdapter(apb.LoadAdapterRequest(id="shared", source=str(folder)), metadata=md, timeout=60)
        reply = call(base_url(server) + "/load_lora_adapter", {"lora_name": "shared", "lora_path": str(folder)},
                     key=ADMIN_KEY)  # fmt: skip
        assert reply.status == 400 and "already registered" in reply.body["error"]["message"]
        assert call(base_url(server) + "/unload_lora_adapter", {"lora_name": "shared"}, key=ADMIN_KEY).status == 200
        with pytest.raises(grpc.RpcError) as gone:
            admin.GetAdapter(apb.GetAdapterRequest(id="shared"), metadata=md, timeout=60)
        assert gone.value.code() is grpc.StatusCode.NOT_FOUND


def _store(srv: BackgroundServer) -> AdapterStore:
    assert srv.server is not None and srv.server.runtime.loaded is not None
    lora = srv.server.runtime.loaded.adapters.kind(LoraPart)
    assert lora is not None
    return lora.store


def test_an_adapter_in_use_is_not_unloaded(server: BackgroundServer, roots: tuple[Path, Path]) -> None:
    url, folder = base_url(server), shutil.copytree(roots[0] / "other", roots[0] / "busy")
    assert (
        call(url + "/load_lora_adapter", {"lora_name": "busy", "lora_path": str(folder)}, key=ADMIN_KEY).status == 200
    )
    _store(server).pin("busy")  # what a running request on it holds
    try:
        busy = call(url + "/unload_lora_adapter", {"lora_name": "busy"}, key=ADMIN_KEY)
        assert busy.status == 400 and busy.body["error"]["code"] == "failed_precondition", busy.body
        assert "in use by 1 running request" in busy.body["error"]["message"]
        assert "busy" in [c["id"] for c in call(url + "/models", key=ADMIN_KEY).body["data"]]  # nothing changed
    finally:
        _store(server).unpin("busy")
    assert call(url + "/unload_lora_adapter", {"lora_name": "busy"}, key=ADMIN_KEY).status == 200


def test_the_adapter_routes_answer_503_while_the_model_loads(
    tiny_server: Callable[..., BackgroundServer], roots: tuple[Path, Path]
) -> None:
    waiting = tiny_server(http_port=0, adapter_roots=(roots[0],), load=False)
    body = {"lora_name": "sql", "lora_path": str(roots[0] / "sql")}
    for route in ("/load_lora_adapter", "/unload_lora_adapter"):
        reply = call(base_url(waiting) + route, body)
        assert (reply.status, reply.headers["retry-after"]) == (503, "1"), reply.body


def test_a_bare_hub_repo_id_is_read_from_the_servers_cache_as_vllm_reads_it(
    tiny_server: Callable[..., BackgroundServer], roots: tuple[Path, Path], tmp_path: Path
) -> None:
    cache, commit = tmp_path / "hub", "c" * 40
    repo = cache / "models--acme--sql"
    shutil.copytree(roots[0] / "sql", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    srv = tiny_server(http_port=0, hf_hub_cache=cache, adapter_roots=(cache,))
    reply = call(base_url(srv) + "/load_lora_adapter", {"lora_name": "hub-sql", "lora_path": "acme/sql"})
    assert (reply.status, reply.body) == (200, "Success: LoRA adapter 'hub-sql' added successfully.")
    card = next(c for c in call(base_url(srv) + "/models").body["data"] if c["id"] == "hub-sql")
    assert card["root"] == "hf://acme/sql"
    absent = call(base_url(srv) + "/load_lora_adapter", {"lora_name": "hub-x", "lora_path": "acme/not-cached"})
    assert absent.status == 404 and "never downloads" in absent.body["error"]["message"], absent.body
