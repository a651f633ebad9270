"""The call observer: what every finished call of either edge reports, written once for both.

An edge ``begin`` s one ``ObservedCall`` per call (gRPC: ``service.api.access.AccessInterceptor``; HTTP: each
route of ``service.api.http.app``) with its request id, ``method`` label and peer; for the rest of the call's task
it is ``CURRENT`` and ``service.logs.REQUEST_ID`` is its id, so the frontend counts tokens into it (``submitted``
/ ``observe``) and every log line names the id. ``finish(code)`` (the gRPC status name the call ended with, the
same vocabulary for both edges) writes, once: one ``loraplex_requests_total`` sample, one
``loraplex_adapter_requests_total`` sample for a generation call (``per_adapter``, through ``metrics.ADAPTERS``,
which bounds the label), and one ``event=access`` line on ``loraplex.access``:
``method adapter code prompt_tokens generated_tokens ttft_seconds duration_seconds peer`` (``ttft_seconds`` empty
when no token was generated; ``peer`` as gRPC writes it, ``ipv4:host:port``, for HTTP calls too).

It never decides a code: the edge does (gRPC: from the status sent; HTTP: from the error replied).
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service import metrics
from service.engine.request import TokenEvent
from service.logs import REQUEST_ID

log = logging.getLogger("loraplex.access")


@dataclass
class Access:
    """What the access line of one call reports; the frontend adds tokens and the first token's time."""

    request_id: str
    method: str
    adapter: str
    peer: str
    started: float  # time.monotonic()
    prompt_tokens: int = 0
    generated_tokens: int = 0
    first_token: float | None = None

    def fields(self, code: str, now: float) -> dict[str, Any]:
        ttft = None if self.first_token is None else round(self.first_token - self.started, 6)
        return {
            "method": self.method,
            "adapter": self.adapter,
            "code": code,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_seconds": ttft,
            "duration_seconds": round(now - self.started, 6),
            "peer": self.peer,
        }


class ObservedCall:
    """One call's record and its one report. ``adapter``: the adapter the call is about (the access line's);
    ``per_adapter``: whether it is a generation call, counted per adapter. ``decided``: the code an edge already
    sent for it (a status sent before the call was cancelled counts as that status)."""

    def __init__(self, method: str, request_id: str, peer: str, known: Callable[[str], bool]) -> None:
        self.record = Access(request_id, method, "", peer, time.monotonic())
        self.per_adapter = False
        self.decided: str | None = None
        self._known = known
        self._done = False
        self._tokens: tuple[contextvars.Token[str | None], contextvars.Token[ObservedCall | None]] | None = None

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def adapter(self) -> str:
        return self.record.adapter

    @adapter.setter
    def adapter(self, adapter_id: str) -> None:
        self.record.adapter = adapter_id

    def finish(self, code: str) -> None:
        """Report the call as ended with ``code`` (or with ``decided``, when set): metrics and the access line."""
        if self._done:
            return
        self._done = True
        code = self.decided or code
        metrics.REQUESTS.labels(self.record.method, code).inc()
        if self.per_adapter:
            adapter_id = self.record.adapter
            metrics.ADAPTERS.request_finished(adapter_id, code, known=self._known(adapter_id))
        log.info("event=access", extra={"fields": self.record.fields(code, time.monotonic())})

    def end(self) -> None:
        """Leave the call's context (``begin`` set it): for an edge whose calls share a task."""
        if self._tokens is not None:
            id_token, call_token = self._tokens
            CURRENT.reset(call_token)
            REQUEST_ID.reset(id_token)
            self._tokens = None


CURRENT: contextvars.ContextVar[ObservedCall | None] = contextvars.ContextVar("loraplex_call", default=None)


def begin(method: str, request_id: str, peer: str, known: Callable[[str], bool]) -> ObservedCall:
    """Observe a new call: it is ``CURRENT``, and its id ``REQUEST_ID``, from here on in this task."""
    call = ObservedCall(method, request_id, peer, known)
    call._tokens = (REQUEST_ID.set(request_id), CURRENT.set(call))
    return call


def peer_of(host: str, port: int) -> str:
    """An HTTP client's address written as gRPC writes a peer (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``), so access
    lines of both APIs can be read and queried alike."""
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def labelled(adapter_id: str) -> None:
    """The current call's adapter, once checked: a mixture's first adapter (what its metrics and access line name),
    also where the request left ``adapter_id`` / ``model`` to the base."""
    call = CURRENT.get()
    if call is not None and adapter_id:
        call.adapter = adapter_id


def submitted(prompt_tokens: int) -> None:
    """A prompt of the current call went to the engine."""
    call = CURRENT.get()
    if call is not None:
        call.record.prompt_tokens += prompt_tokens


def observe(event: TokenEvent) -> None:
    """An engine event of the current call reached the frontend."""
    call = CURRENT.get()
    if call is None or not event.token_ids:
        return
    record = call.record
    if record.first_token is None:
        record.first_token = time.monotonic()
    record.generated_tokens += len(event.token_ids)


def decided(method: str, code: str) -> None:
    """An edge is about to send status ``code`` for the current call: report the call now, before the status can
    reach the client (a client that scrapes the metrics right after its error then finds it counted), and let its
    later ``finish`` (whatever the call's task ends with) change nothing. A call no observer watches (health,
    reflection) is counted here too."""
    call = CURRENT.get()
    if call is None:
        metrics.REQUESTS.labels(method, code).inc()
    else:
        call.decided = code
        call.finish(code)
