"""Server assembly: gRPC (generation, adapters, health, reflection), the OpenAI-compatible HTTP API, /metrics,
loading, graceful drain.

Start-up order: bind gRPC with health NOT_SERVING → start /metrics → load the model on a worker thread →
SERVING. On SIGTERM/SIGINT: NOT_SERVING, new generation RPCs get UNAVAILABLE, running streams get up to
``grace_seconds`` to finish, then the server stops and ``run`` returns 0.
gRPC and the HTTP API (``--http-port``, same host, same event loop, ``service.api.http``) are plaintext or TLS
(``--tls-cert``; mutual with ``--tls-client-ca``); /metrics is always plain HTTP (bind it to a private address).
Every RPC passes the interceptor chain of ``service.api.interceptors`` (API-key roles, safe decoding, error
statuses, request metrics) before its servicer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loraplex.v1 import adapters_pb2, adapters_pb2_grpc, generation_pb2, generation_pb2_grpc
from prometheus_client import start_http_server

from service import __version__, logs, metrics
from service.api import interceptors, reflection
from service.api.adapters import AdaptersServicer
from service.api.auth import KeyRing
from service.api.generation import GenerationServicer
from service.api.health import HealthServicer
from service.api.http import HttpListener, OpenAIRoutes
from service.api.runtime import Runtime
from service.api.signals import StopSignals, exit_now, ignore_stop
from service.api.tls import CertificateFiles, server_credentials
from service.config import Settings
from service.cpu_budget import read_cpu_budget
from service.engine.engine import Engine
from service.frontend import Frontend
from service.heap import MMAP_THRESHOLD_BYTES, fix_mmap_threshold
from service.torch_threads import in_own_thread, pool_thread, serial_torch

log = logging.getLogger("loraplex.server")

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADAPTERS_SERVICE = adapters_pb2.DESCRIPTOR.services_by_name["Adapters"].full_name
SERVICES = (GENERATION_SERVICE, ADAPTERS_SERVICE)


CLOSE_SECONDS = 0.4
"""After the grace period: the time the drain takes at most to cut what still runs and close every part (the drain's
promise is the grace plus 0.5 s, ``DRAIN_OVERRUN_SECONDS``, SIGTERM to exit)."""
STOP_SECONDS = 0.1  # of CLOSE_SECONDS: kept for the transports to stop after the cut calls' statuses went out
DRAIN_OVERRUN_SECONDS = 0.5
TORCH_THREADS = frozenset({"loraplex-model-load", "loraplex-engine", "loraplex-adapter-loader"})
"""The service's threads that run torch work no stop can interrupt (the process does not wait for them)."""


@dataclass(frozen=True)
class DrainOutcome:
    """What a drain did: the grace it had, how long it took (its start to everything closed), and how many requests
    were still running at the grace's end and were cut with UNAVAILABLE."""

    grace_seconds: float
    seconds: float
    cut: int

    @property
    def within_grace(self) -> bool:
        """Whether the drain kept its promise: done within the grace plus ``DRAIN_OVERRUN_SECONDS``."""
        return self.seconds <= self.grace_seconds + DRAIN_OVERRUN_SECONDS


@dataclass
class Server:
    """A started server. ``port`` is the bound gRPC port (useful with port 0)."""

    settings: Settings
    runtime: Runtime
    grpc_server: grpc.aio.Server
    health: HealthServicer
    port: int
    metrics_http: WSGIServer | None
    tls: CertificateFiles | None = None  # the watched certificate files when serving TLS
    http: HttpListener | None = None  # the OpenAI-compatible HTTP API (--http-port), None when off

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_http is None else int(self.metrics_http.server_port)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICES):
            await self.health.set(name, status)

    async def load(self) -> None:
        """Load the model off the event loop, then report SERVING."""
        try:
            # Its own thread, which exits after the load: its OpenMP workers go with it (service.torch_threads).
            threads = self.settings.threads if self.settings.threads > 0 else read_cpu_budget().threads
            await in_own_thread(self.runtime.load, threads=threads, name="loraplex-model-load")
        except BaseException as exc:
            self.runtime.load_error = exc
            raise
        metrics.MODEL_LOADED.set(1)
        await self.set_serving(True)

    async def drain(self, grace: float | None = None) -> DrainOutcome:
        """NOT_SERVING, refuse new work, let running requests finish for up to ``grace`` seconds; then cut what still
        runs (UNAVAILABLE) and close everything within ``CLOSE_SECONDS``."""
        grace = self.settings.grace_seconds if grace is None else grace
        started = time.monotonic()
        deadline = started + grace
        self.runtime.draining = True
        await self.set_serving(False)
        engine = None if self.runtime.loaded is None else self.runtime.loaded.engine
        while engine is not None and engine.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        cut = 0 if engine is None else engine.in_flight
        if cut:
            log.warning("event=drain_grace_ended", extra={"fields": {"grace_seconds": grace, "cut": cut}})
        await self._close(engine, time.monotonic() + CLOSE_SECONDS)
        return DrainOutcome(grace, time.monotonic() - started, cut)

    async def abandon(self) -> None:
        """Stop everything at once while the model is still loading (nothing is being served yet)."""
        self.runtime.draining = True
        await self._close(None, time.monotonic() + CLOSE_SECONDS)

    async def _close(self, engine: Engine | None, close_by: float) -> None:
        """Cut what still runs and stop every part, each wait bounded so that all is done by ``close_by``."""
        metrics_stopped = self._stop_metrics()
        if engine is not None:
            engine.stop(timeout=0)  # it ends the step it is in, then fails every request left with UNAVAILABLE
            while engine.in_flight and time.monotonic() < close_by - STOP_SECONDS:
                await asyncio.sleep(0.01)  # the cut calls end with their status, before the transports stop
        left = max(0.0, close_by - time.monotonic() - STOP_SECONDS)
        stops = [self.grpc_server.stop(left)]
        if self.http is not None:
            stops.append(self.http.stop(left))
        await asyncio.gather(*stops)
        await asyncio.to_thread(self.runtime.close, max(0.0, close_by - time.monotonic()))
        while not metrics_stopped.is_set() and time.monotonic() < close_by:
            await asyncio.sleep(0.01)

    def _stop_metrics(self) -> threading.Event:
        """Stop /metrics on a thread of its own (its serve loop looks at the request every half second)."""
        done = threading.Event()
        served = self.metrics_http
        if served is None:
            done.set()
            return done

        def stop() -> None:
            served.shutdown()
            served.server_close()
            done.set()

        self.metrics_http = None
        threading.Thread(target=stop, name="loraplex-metrics-stop", daemon=True).start()
        return done


def grpc_options(settings: Settings) -> list[tuple[str, int]]:
    """Channel arguments of the gRPC server: message size both ways, connection ageing."""
    options = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    if settings.max_connection_age_seconds > 0:
        # Clients balancing with round_robin only see replicas added by a scale-up when they reconnect: age
        # connections out. The GOAWAY stops new calls on the connection; calls running on it may finish for the
        # grace period, unlimited by default, so a long stream is never cut by ageing.
        options.append(("grpc.max_connection_age_ms", _millis(settings.max_connection_age_seconds)))
        if math.isfinite(settings.max_connection_age_grace_seconds):
            options.append(("grpc.max_connection_age_grace_ms", _millis(settings.max_connection_age_grace_seconds)))
    return options


def _millis(seconds: float) -> int:
    return min(int(seconds * 1000), (1 << 31) - 1)


async def start(settings: Settings) -> Server:
    """Bind and start everything except the model load (call ``Server.load`` next)."""
    metrics.BUILD_INFO.info({"version": __version__, "python": sys.version.split()[0]})
    keys = KeyRing.from_settings(settings)  # a bad --api-key-file fails here, naming its line
    tls = server_credentials(settings)
    metrics.ADAPTERS.reset(settings.metrics_adapter_series)
    runtime = Runtime(settings)
    chain = interceptors.chain(keys, services=SERVICES, known_adapter=runtime.knows_adapter)
    server = grpc.aio.server(interceptors=chain, options=grpc_options(settings))
    frontend = Frontend(runtime)
    generation = GenerationServicer(runtime, frontend)
    generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    adapters_pb2_grpc.add_AdaptersServicer_to_server(AdaptersServicer(runtime), server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_service = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.add_to_server(server, (*SERVICES, health_service), health_pb2)  # v1 and v1alpha
    address = f"{settings.host}:{settings.port}"
    port = server.add_insecure_port(address) if tls is None else server.add_secure_port(address, tls[0])
    if port == 0:
        raise OSError(f"could not bind gRPC to {address}")
    await server.start()
    metrics_http = None
    if settings.metrics_port >= 0:
        metrics_http, _ = start_http_server(
            settings.metrics_port, addr=settings.metrics_host, registry=metrics.REGISTRY
        )
    running = Server(settings, runtime, server, health_servicer, port, metrics_http, None if tls is None else tls[1])
    await running.set_serving(False)
    # --- HTTP API (service.api.http): the OpenAI routes over the same frontend, keys and TLS files ---
    if settings.http_port >= 0:
        try:
            routes = OpenAIRoutes(runtime, frontend, keys)
            running.http = HttpListener(routes.app(), settings.host, settings.http_port, running.tls)
            await running.http.start()
        except BaseException:
            runtime.close()
            await server.stop(0)
            if metrics_http is not None:
                metrics_http.shutdown()
                metrics_http.server_close()
            raise
    return running


async def serve(settings: Settings, *, announce: bool = True) -> int:
    """Start, load, serve until SIGTERM / SIGINT, drain. A stop signal at any point ends it with 0 and a log line:
    before the model is loaded, the load is abandoned; after, running requests get the grace period."""
    signals = StopSignals(asyncio.get_running_loop())  # from the loop's first step: a stop signal is an event
    server = await start(settings)
    log.info(
        "event=listening grpc=%s:%d tls=%s mtls=%s metrics_port=%s http_port=%s",
        settings.host, server.port, server.tls is not None, settings.tls_client_ca is not None, server.metrics_port,
        None if server.http is None else server.http.port,
    )  # fmt: skip
    loading = asyncio.create_task(server.load())
    stopper = asyncio.create_task(signals.stopped.wait())
    done, _ = await asyncio.wait({loading, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if loading in done and loading.exception() is not None:
        log.error("event=load_failed error=%s", loading.exception())
        stopper.cancel()
        await server.abandon()
        return 1
    if loading not in done:  # stopped while the model loads: nothing to drain
        stage = {"signal": signals.received, "stage": "loading"}
        log.info("event=startup_interrupted", extra={"fields": stage})
        loading.cancel()
        await server.abandon()
        log.info("event=stopped", extra={"fields": stage})
        return 0
    if announce:
        _announce(settings, server)
    await stopper
    grace = {"signal": signals.received, "grace_seconds": settings.grace_seconds}
    log.info("event=draining", extra={"fields": grace})
    outcome = await server.drain()
    drained = {"drain_seconds": round(outcome.seconds, 3), "cut": outcome.cut, "within_grace": outcome.within_grace}
    log.info("event=stopped", extra={"fields": {**grace, **drained}})
    return 0


def _announce(settings: Settings, server: Server) -> None:
    """The ``event=serving`` line, and with text logs a how-to-call banner for people (JSON logs stay one object
    per line: log collectors read them)."""
    target = f"{settings.host}:{server.port}"
    url = None if server.http is None else f"{server.http.scheme}://{settings.host}:{server.http.port}/v1"
    metrics_url = None if server.metrics_port is None else f"http://{settings.metrics_host}:{server.metrics_port}"
    log.info(
        "event=serving version=%s model=%s grpc=%s http=%s metrics=%s",
        __version__, settings.model, target, url, metrics_url,
    )  # fmt: skip
    if settings.log_format != "text":
        return
    lines = [
        f"loraplex {__version__} is SERVING {settings.model} on {target}",
        f"  try:     .venv/bin/loraplex generate --target {target} 'What is the capital of France?'",
        f"  model:   .venv/bin/loraplex info --target {target}",
    ]
    if url is not None:
        lines.append(f"  openai:  {url} (POST /chat/completions, /completions; GET /models)")
    if metrics_url is not None:
        lines.append(f"  metrics: {metrics_url}/metrics")
    print("\n".join(lines), file=sys.stderr, flush=True)


def serial_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Called on the thread that will run ``loop``: it and the threads behind ``asyncio.to_thread`` run torch
    serially, so only the engine thread starts parallel kernels (service.torch_threads)."""
    serial_torch()
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="loraplex-io", initializer=pool_thread))


def run(settings: Settings) -> NoReturn:
    """Entry point of `loraplex serve`. It returns only by an exception raised before serving began (a bad setting, a
    port in use, a stop signal before the event loop ran: ``service.api.signals``); once ``serve`` has run, the
    process ends in ``exit_now`` with its code, right after the drain: the interpreter's own teardown of a loaded
    model takes longer than the drain's bound leaves, and can abort under a torch thread still at work."""
    logs.configure(settings.log_format, settings.log_level)
    heap = {"mmap_threshold_bytes": MMAP_THRESHOLD_BYTES, "how": fix_mmap_threshold()}
    log.info("event=heap", extra={"fields": heap})  # before the load: see service.heap
    try:
        with asyncio.Runner() as runner:
            serial_loop(runner.get_loop())
            code = runner.run(serve(settings))
    finally:
        ignore_stop()
    running = sorted(t.name for t in threading.enumerate() if t.name in TORCH_THREADS and t.is_alive())
    log.info("event=exit", extra={"fields": {"code": code, "left_running": ",".join(running) or "none"}})
    exit_now(code)


class BackgroundServer:
    """A real server on its own event-loop thread, for tests and in-process benchmarks.

    >>> with BackgroundServer(settings) as srv:
    ...     channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    """

    def __init__(self, settings: Settings, *, load: bool = True) -> None:
        self.settings = settings
        self._load = load
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="loraplex-test-loop", daemon=True)
        self.server: Server | None = None

    def _run_loop(self) -> None:
        serial_loop(self._loop)
        self._loop.run_forever()

    def call(self, coro: object, timeout: float | None = 120.0) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        server = self.call(start(self.settings))
        assert isinstance(server, Server)
        self.server = server
        if self._load:
            self.call(server.load())
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def target(self) -> str:
        return f"{self.settings.host}:{self.port}"

    def stop(self, grace: float = 1.0) -> None:
        if self.server is not None:
            self.call(self.server.drain(grace))
            self.server = None
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._loop.shutdown_default_executor(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __exit__(self, *exc: object) -> None:
        self.stop()
