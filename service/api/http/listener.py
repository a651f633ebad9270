"""The HTTP listener: uvicorn serving the OpenAI routes as a task on the event loop that runs grpc.aio.

uvicorn, not a second process or thread: the routes call the frontend's coroutines directly, as the gRPC
servicer does, so they run on the loop that owns its mailbox and the runtime. Why uvicorn + Starlette: the ASGI
pair the Python serving ecosystem (vLLM, TGI's router clients, FastAPI users) already runs and operates, small
(h11, no C build), with ``Server.serve()`` usable as a coroutine on a running loop; Starlette gives routing,
streaming responses with a disconnect watch, and nothing we do not use.

The socket is bound here, before uvicorn starts, so a taken port fails start-up with an ``OSError`` naming the
address (uvicorn itself would ``sys.exit``), and port 0 reports the port it got. uvicorn installs no signal
handlers (``capture_signals`` is a no-op here): SIGTERM belongs to ``service.api.server.serve``, which drains.
TLS uses the gRPC listener's files (``--tls-cert`` / ``--tls-key``, ``--tls-client-ca`` = client certificates
required) and picks up rotated files at the next handshake, as gRPC does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from service.api.tls import CertificateFiles, Signature

log = logging.getLogger("loraplex.http")

START_TIMEOUT_SECONDS = 10.0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process's signals are the gRPC server's (drain on SIGTERM), never uvicorn's


class TlsContext:
    """An ``ssl.SSLContext`` over ``CertificateFiles`` that swaps in a fresh context when the files change (checked
    at each handshake, through the SNI callback); a half-written rotation keeps the previous certificates."""

    def __init__(self, files: CertificateFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._signature: Signature = files.signature()
        self.reloads = 0
        self.context = self._build()  # the listener's: its SNI callback runs at every handshake
        self.context.sni_callback = self._on_hello
        self.current = self.context  # what new connections get: a fresh context after each rotation

    def _build(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.files.cert, self.files.key)
        if self.files.client_ca is not None:
            ctx.load_verify_locations(cafile=self.files.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def _on_hello(self, sock: ssl.SSLObject | ssl.SSLSocket, name: str | None, ctx: ssl.SSLContext) -> None:
        with self._lock:
            try:
                signature = self.files.signature()
                if signature != self._signature:
                    self.current = self._build()
                    self._signature = signature
                    self.reloads += 1
                    log.info("event=tls_reloaded listener=http")
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.warning("event=tls_reload_failed listener=http error=%s (keeping the previous certificates)", exc)
        if self.current is not self.context:
            sock.context = self.current


class HttpListener:
    """uvicorn on ``host:port`` serving ``app`` on the running loop. ``start`` binds and returns once it accepts."""

    def __init__(self, app: Any, host: str, port: int, tls: CertificateFiles | None) -> None:
        self.tls = None if tls is None else TlsContext(tls)
        factory: Callable[..., ssl.SSLContext] | None = None
        if self.tls is not None:
            context = self.tls.context
            factory = lambda config, default: context  # noqa: E731
        config = uvicorn.Config(
            app, lifespan="off", http="h11", ws="none", log_config=None, access_log=False, server_header=False,
            ssl_context_factory=factory,
        )  # fmt: skip
        self.server = _Server(config)
        self.host = host
        self._socket = _bind(host, port)
        self.port: int = self._socket.getsockname()[1]
        self._task: asyncio.Task[None] | None = None

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    async def start(self) -> None:
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # its start/stop chatter: ours is structured
        self._task = asyncio.create_task(self.server.serve(sockets=[self._socket]), name="loraplex-http")
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_SECONDS
        while not self.server.started:
            if self._task.done():
                self._task.result()  # uvicorn's own error
                raise OSError(f"the HTTP listener on {self.host}:{self.port} stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise OSError(f"the HTTP listener on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)

    async def stop(self, grace: float) -> None:
        """Stop accepting, give open connections up to ``grace`` seconds, then cut them: done within ``grace``
        plus a tick of uvicorn's loop (uvicorn's own graceful timeout is whole seconds, so the cut is ours)."""
        if self._task is None:
            self._socket.close()
            return
        task, self._task = self._task, None
        self.server.config.timeout_graceful_shutdown = max(1, math.ceil(grace))  # uvicorn's field is an int
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=grace)
        except TimeoutError:
            self.server.force_exit = True
            for connection in list(self.server.server_state.tasks):
                connection.cancel()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (``[::]`` and IPv6 literals too)."""
    bare = host.strip("[]")
    family, kind, proto, _, address = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"could not bind the HTTP API to {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock
