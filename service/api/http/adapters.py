"""vLLM's adapter routes on the OpenAI edge: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

The bodies, status codes and replies are vLLM's, so its dynamic-LoRA tooling (the inference gateway's sidecar,
scripts written for ``vllm serve``) works unchanged: ``{"lora_name", "lora_path"}`` / ``{"lora_name"}`` in, 200
with vLLM's plain-text ``Success: ...`` line out; an id already loaded is 400 (gRPC says ALREADY_EXISTS), an
unknown id on unload or a missing folder 404. Errors keep this edge's OpenAI error object. Where loraplex is
stricter than vLLM it stays so: the admin role (``KeyRing``, as gRPC's Adapters service), ``--adapter-root``
(403 outside every root) and the adapter id rule, all through the seam gRPC uses (``service.frontend.adapters``),
never checked here a second time. Unknown body fields are ignored, as vLLM ignores them (``lora_int_id``,
``load_inplace``). A bare ``org/name`` ``lora_path`` is a Hugging Face repo id, as in vLLM, but read from the
server's cache (``hf://``), never downloaded.

Each call is observed as every route is: ``method="http.load_lora_adapter"`` / ``"http.unload_lora_adapter"``.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from service.adapters.catalog import AdapterCatalog
from service.adapters.common.ids import is_adapter_id
from service.api.auth import KeyRing
from service.api.http import errors
from service.api.runtime import Runtime
from service.errors import AdapterNotFound, AlreadyExists, InvalidRequest, NotFound
from service.frontend.adapters import AdapterAdmin
from service.frontend.observer import ObservedCall
from service.logs import REQUEST_ID_HEADER

LOAD_METHOD = "/loraplex.v1.Adapters/LoadAdapter"
UNLOAD_METHOD = "/loraplex.v1.Adapters/UnloadAdapter"
"""The gRPC methods whose role each route needs (``KeyRing.authorize``): admin."""

HUB_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
"""A bare ``org/name``: vLLM reads such a ``lora_path`` (when it is no local folder) as a Hugging Face repo id."""

Observe = Callable[[str, Request], ObservedCall]
ReadBody = Callable[[Request, int], Awaitable[object]]


class AdapterRoutes:
    def __init__(self, runtime: Runtime, keys: KeyRing, observe: Observe, body: ReadBody) -> None:
        self.runtime = runtime
        self.keys = keys
        self.admin = AdapterAdmin(runtime)
        self._observe, self._body = observe, body

    async def load(self, request: Request) -> Response:
        outcome = self._observe("http.load_lora_adapter", request)
        try:
            name, path = await self._fields(request, LOAD_METHOD, outcome, ("lora_name", "lora_path"))
            await self.admin.load(name, _source(path), id_field="lora_name", source_field="lora_path")
        except Exception as exc:
            return _refused(_as_vllm(exc), outcome)
        return _done(f"Success: LoRA adapter '{name}' added successfully.", outcome)

    async def unload(self, request: Request) -> Response:
        outcome = self._observe("http.unload_lora_adapter", request)
        try:
            (name,) = await self._fields(request, UNLOAD_METHOD, outcome, ("lora_name",))
            self.admin.unload(name, _resolve, id_field="lora_name")
        except Exception as exc:
            return _refused(_as_vllm(exc), outcome)
        return _done(f"Success: LoRA adapter '{name}' removed successfully.", outcome)

    async def _fields(self, request: Request, method: str, outcome: ObservedCall, names: tuple[str, ...]) -> list[str]:
        """The route's string fields, after the key and the serving state (a field left out is "": the seam
        refuses it by name)."""
        header = request.headers.get("authorization")
        self.keys.authorize(method, [] if header is None else [("authorization", header)])
        rt = self.runtime.ready()
        body = await self._body(request, rt.settings.max_message_bytes)
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        values = [_string(body, name) for name in names]
        if is_adapter_id(values[0]):
            outcome.adapter = values[0]
        return values


def _string(body: dict[str, Any], name: str) -> str:
    value = body.get(name, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, not {type(value).__name__}", field=name)
    return value


def _source(lora_path: str) -> str:
    """``lora_path`` as a loraplex source: a bare ``org/name`` is that repo in the server's Hugging Face cache
    (``hf://org/name``: read from the cache only, never downloaded, and only inside a root); anything else as
    given, so folders are given as absolute paths."""
    if HUB_REPO_ID.fullmatch(lora_path) and ".." not in lora_path:
        return "hf://" + lora_path
    return lora_path


def _resolve(catalog: AdapterCatalog, adapter_id: str) -> object:
    return catalog.resolve(adapter_id)  # AdapterNotFound for an id not registered


def _as_vllm(exc: Exception) -> Exception:
    """vLLM answers a name already loaded with 400, not 409: the same message, as an invalid request. An unknown
    name is a plain 404 with the message gRPC sends (not the edge's ``model_not_found``: no ``model`` was named)."""
    if isinstance(exc, AlreadyExists):
        return InvalidRequest(str(exc), field="lora_name")
    if isinstance(exc, AdapterNotFound):
        return NotFound(str(exc))
    return exc


def _done(text: str, outcome: ObservedCall) -> Response:
    outcome.finish("OK")
    return PlainTextResponse(text, headers={REQUEST_ID_HEADER: outcome.request_id})


def _refused(exc: Exception, outcome: ObservedCall) -> JSONResponse:
    outcome.finish(errors.status_name(exc))
    body = errors.error_body(exc, chat=False)
    headers = {**errors.headers_of(exc), REQUEST_ID_HEADER: outcome.request_id}
    return JSONResponse(body, status_code=errors.http_status(exc), headers=headers)
