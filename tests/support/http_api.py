"""Helpers for the HTTP API tests: raw requests with the standard library (status, headers and JSON body as the
server sent them, errors included), the base URL of a started server, and reading request metrics."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from service.api.server import BackgroundServer
from support.metrics import sample


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: Any


def base_url(srv: BackgroundServer, scheme: str = "http") -> str:
    assert srv.server is not None and srv.server.http is not None
    return f"{scheme}://127.0.0.1:{srv.server.http.port}/v1"


def call(
    url: str,
    body: object | None = None,
    *,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
    timeout: float = 60,
) -> Reply:
    """``POST`` ``body`` as JSON, or as sent where it is bytes (``GET`` without one); HTTP errors are returned."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("content-type", "application/json")
    if key is not None:
        request.add_header("authorization", f"Bearer {key}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            raw, status, got = response.read(), response.status, dict(response.headers)
    except urllib.error.HTTPError as err:
        raw, status, got = err.read(), err.code, dict(err.headers)
    lowered = {k.lower(): v for k, v in got.items()}
    text = raw.decode()
    is_json = lowered.get("content-type", "").startswith("application/json")
    return Reply(status, lowered, json.loads(text) if is_json else text)


def requests_count(method: str, code: str) -> float:
    """``loraplex_requests_total{method, code}`` now (0 before the first such request)."""
    return sample("loraplex_requests_total", method=method, code=code)


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order; asserts every event is one ``data:`` line."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        events.append(block.removeprefix("data: "))
    return events
