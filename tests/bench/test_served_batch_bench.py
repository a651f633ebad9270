"""bench/served_batch.py must not rot: its CPU split by thread reads the OS names the server's threads carry, and
its scrape reads the counters it reports from a real /metrics endpoint."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import start_http_server
from support.paths import ROOT

from service import metrics
from service.torch_threads import name_os_thread

sys.path.insert(0, str(ROOT / "bench"))
from peers_loraplex import free_port
from served_batch import scrape, thread_cpu

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")


def test_thread_cpu_counts_a_thread_named_engine_in_the_os_as_the_engines() -> None:
    ready, done = threading.Event(), threading.Event()

    def spin() -> None:
        name_os_thread()
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        ready.set()
        done.wait(30)

    thread = threading.Thread(target=spin, name="loraplex-engine")
    thread.start()
    assert ready.wait(30)
    try:
        cpu = thread_cpu(os.getpid())
    finally:
        done.set()
        thread.join(30)
    assert cpu["engine"] >= 0.1
    assert set(cpu) == {"engine", "loop", "other"}


def test_scrape_reads_decode_steps_and_prefill_passes_from_metrics() -> None:
    port = free_port()
    server, worker = start_http_server(port, registry=metrics.REGISTRY)
    try:
        before = scrape(port)
        metrics.BATCH_SIZE.observe(32)
        metrics.PREFILL_PASS_SECONDS.observe(0.25)
        after = scrape(port)
    finally:
        server.shutdown()
        worker.join(10)
    assert after["decode_steps"] - before["decode_steps"] == 1
    assert after["prefill_passes"] - before["prefill_passes"] == 1
    assert after["prefill_s"] - before["prefill_s"] == pytest.approx(0.25)
