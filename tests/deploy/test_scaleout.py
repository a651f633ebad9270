"""Scale-out: several replicas share load through client-side ``round_robin`` or through nginx adapter affinity.

Three real ``loraplex serve`` processes (the tiny random Llama, every adapter folder registered lazily) run on
free loopback ports; each has its own ``/metrics``, so what each replica served is read from its own counters
(in-process servers would share one Prometheus registry). Requests go
  * through ``loraplex.Client("ipv4:a,b,c", load_balancing="round_robin")``: every replica serves some;
  * through nginx (Debian's, from ``scripts/system_deps.sh``) running ``deploy/nginx/loraplex-affinity.conf.template``
    with the three replicas as upstreams: every request of one adapter lands on one replica (the client sends the
    adapter id as the ``x-loraplex-adapter`` header, nginx hashes it consistently), checked on every replica with
    ``GetAdapter`` (hits, loads) and its counters (Generate RPCs, device-tier misses, resident adapters).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from string import Template

import pytest
from loraplex import ADAPTER_HEADER, Client, HealthStatus, NotFound
from prometheus_client.parser import text_string_to_metric_families
from support.adapter_files import write_peft_adapter
from support.paths import ROOT
from support.servers import free_port, free_ports

TEMPLATE = ROOT / "deploy" / "nginx" / "loraplex-affinity.conf.template"
LORAPLEX = Path(sys.executable).parent / "loraplex"  # the console script of the venv running the tests
REPLICAS = 3
ADAPTERS = [f"tenant-{i:02d}" for i in range(12)]
GENERATION_SERVICE = "loraplex.v1.Generation"
START_TIMEOUT = 120.0  # three processes importing torch at once on two cores


def wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Poll ``ready()`` until it is true; fail early, with the log, if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        if ready():
            return
        time.sleep(0.1)
    pytest.fail(f"{what} not ready after {timeout} s:\n{log.read_text()[-4000:]}")


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ------------------------------------------------------------------------------------------------ replicas


@dataclass(frozen=True)
class Replica:
    port: int
    metrics_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def serving(self) -> bool:
        # A fresh channel per probe: a channel that failed to connect backs off for seconds before retrying.
        try:
            with Client(self.address, timeout=1) as client:
                return client.health(GENERATION_SERVICE) is HealthStatus.SERVING
        except Exception:
            return False

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of this replica's /metrics: (series name, sorted labels) -> value."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


def counters(replicas: list[Replica]) -> list[dict[str, float]]:
    """Per replica: OK Generate RPCs, device-tier adapter misses, adapters resident on the device."""
    out = []
    for replica in replicas:
        samples = replica.samples()
        out.append(
            {
                "generate": samples.get(("loraplex_requests_total", (("code", "OK"), ("method", "Generate"))), 0.0),
                "device_misses": samples.get(
                    ("loraplex_adapter_cache_events_total", (("event", "miss"), ("tier", "device"))), 0.0
                ),
                "device_resident": samples.get(("loraplex_adapter_resident", (("tier", "device"),)), 0.0),
            }
        )
    return out


def deltas(before: list[dict[str, float]], after: list[dict[str, float]], key: str) -> list[int]:
    return [round(a[key] - b[key]) for b, a in zip(before, after, strict=True)]


@pytest.fixture(scope="module")
def adapter_dir(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twelve LoRA adapters (copies of one: routing, not weights, is under test), registered by every replica."""
    root = tmp_path_factory.mktemp("scaleout_adapters")
    first = write_peft_adapter(root / ADAPTERS[0], served_tiny_dir, r=4, alpha=8, seed=11, scale=0.5)
    for name in ADAPTERS[1:]:
        shutil.copytree(first, root / name)
    return root


@pytest.fixture(scope="module")
def replicas(
    served_tiny_dir: Path, adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Replica]]:
    logs = tmp_path_factory.mktemp("scaleout_logs")
    started: list[tuple[Replica, subprocess.Popen[bytes], Path]] = []
    try:
        ports = free_ports(2 * REPLICAS)
        for i in range(REPLICAS):
            replica = Replica(ports[2 * i], ports[2 * i + 1])
            log = logs / f"replica{i}.log"
            with log.open("wb") as sink:
                proc = subprocess.Popen(
                    [
                        str(LORAPLEX), "serve", "--model", str(served_tiny_dir),
                        "--port", str(replica.port), "--metrics-port", str(replica.metrics_port), "--http-port", "-1",
                        "--adapter-dir", str(adapter_dir), "--threads", "1", "--max-batch-size", "4",
                        "--max-new-tokens", "16", "--grace-seconds", "1", "--dtype", "float32",
                    ],
                    stdout=sink, stderr=subprocess.STDOUT,
                )  # fmt: skip
            started.append((replica, proc, log))
        for replica, proc, log in started:
            wait_for(f"replica {replica.address}", replica.serving, proc, log, START_TIMEOUT)
        yield [replica for replica, _, _ in started]
    finally:
        stop([proc for _, proc, _ in started])


def generate(client: Client, n: int, adapter: str | None = None) -> None:
    for i in range(n):
        result = client.generate(f"Request {i}", adapter=adapter, max_new_tokens=2, ignore_eos=True)
        assert result.usage.generated_tokens == 2


@pytest.mark.slow
def test_round_robin_spreads_calls_over_every_replica(replicas: list[Replica]) -> None:
    target = "ipv4:" + ",".join(r.address for r in replicas)
    before = counters(replicas)
    with Client(target, load_balancing="round_robin", timeout=30) as client:
        generate(client, 15)
    served = deltas(before, counters(replicas), "generate")
    assert sum(served) == 15
    assert all(n > 0 for n in served), f"round_robin left a replica idle: {served}"


@pytest.mark.slow
def test_without_round_robin_one_replica_serves_every_call(replicas: list[Replica]) -> None:
    """The contrast: gRPC's default policy (pick_first) keeps one connection, so one replica gets everything."""
    target = "ipv4:" + ",".join(r.address for r in replicas)
    before = counters(replicas)
    with Client(target, timeout=30) as client:
        generate(client, 6)
    assert sorted(deltas(before, counters(replicas), "generate")) == [0, 0, 6]


# ---------------------------------------------------------------------------------------------------- nginx


def nginx_binary() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)
    if path is None:
        pytest.fail("nginx is missing: run scripts/system_deps.sh (Debian package `nginx`)")
    return path


def write_nginx_config(prefix: Path, listen: str, upstreams: list[str]) -> Path:
    """The deploy template filled like the nginx image's entrypoint would, inside a self-contained main config
    (logs, pid and temp files under ``prefix``)."""
    prefix.mkdir(parents=True, exist_ok=True)
    filled = Template(TEMPLATE.read_text()).safe_substitute(
        LORAPLEX_PROXY_LISTEN=listen,
        LORAPLEX_UPSTREAM_SERVERS=" ".join(f"server {address};" for address in upstreams),
    )
    assert "${" not in filled, "a placeholder of the template was left unfilled"
    (prefix / "loraplex-affinity.conf").write_text(filled)
    # As root, workers would drop to a user that cannot enter pytest's private temp folders.
    user = "user root;\n" if os.geteuid() == 0 else ""
    temp = "\n".join(
        f"    {kind}_temp_path {prefix / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    main = prefix / "nginx.conf"
    main.write_text(
        f"{user}worker_processes 1;\nerror_log {prefix / 'error.log'} notice;\npid {prefix / 'nginx.pid'};\n"
        f"events {{ worker_connections 256; }}\n"
        f"http {{\n    access_log {prefix / 'access.log'};\n{temp}\n"
        f"    include {prefix / 'loraplex-affinity.conf'};\n}}\n"
    )
    return main


def nginx_command(prefix: Path, conf: Path, *extra: str) -> list[str]:
    return [nginx_binary(), "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log"), *extra]


def test_template_routes_on_the_clients_adapter_header(tmp_path: Path) -> None:
    """The hash key is the header the client sends, and the filled template passes ``nginx -t``."""
    text = TEMPLATE.read_text()
    variable = "$http_" + ADAPTER_HEADER.replace("-", "_")
    assert f"map {variable} $loraplex_route_key" in text
    assert "hash $loraplex_route_key consistent;" in text
    assert "grpc_pass grpc://loraplex_replicas;" in text
    conf = write_nginx_config(tmp_path, f"127.0.0.1:{free_port()}", ["127.0.0.1:1", "127.0.0.1:2"])
    proc = subprocess.run(nginx_command(tmp_path, conf, "-t"), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_nginx_check_can_fail(tmp_path: Path) -> None:
    """An upstream without servers is an error ``nginx -t`` reports: the check above is not vacuous."""
    conf = write_nginx_config(tmp_path, f"127.0.0.1:{free_port()}", [])
    proc = subprocess.run(nginx_command(tmp_path, conf, "-t"), capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "no servers" in proc.stderr


@pytest.fixture(scope="module")
def nginx(replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """nginx in front of the replicas; yields its gRPC target."""
    prefix = tmp_path_factory.mktemp("nginx")
    port = free_port()
    conf = write_nginx_config(prefix, f"127.0.0.1:{port}", [r.address for r in replicas])
    log = prefix / "error.log"
    proc = subprocess.Popen(
        nginx_command(prefix, conf, "-g", "daemon off;"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    target = f"127.0.0.1:{port}"

    def listening() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    try:
        log.touch()
        wait_for("nginx", listening, proc, log, 30)
        yield target
    finally:
        stop([proc])


@pytest.mark.slow
def test_nginx_keeps_each_adapter_on_one_replica(replicas: list[Replica], nginx: str) -> None:
    per_adapter = 3
    before = counters(replicas)
    with Client(nginx, timeout=60) as client:
        for _ in range(per_adapter):  # interleaved: adapter a, b, c, ..., a, b, c, ...
            for adapter in ADAPTERS:
                generate(client, 1, adapter)
    after = counters(replicas)

    owners: dict[str, int] = {}
    for adapter in ADAPTERS:
        infos = []
        for replica in replicas:
            with Client(replica.address, timeout=10) as client:
                infos.append(client.get_adapter(adapter))
        used = [i for i, info in enumerate(infos) if info.hits > 0]
        assert len(used) == 1, f"{adapter} served by replicas {used}: hits {[info.hits for info in infos]}"
        owner = infos[used[0]]
        owners[adapter] = used[0]
        # Every request found it resident but the first, which loaded it: one load, on one replica only.
        assert owner.hits == per_adapter and owner.loads == 1 and owner.device_layers == owner.num_layers > 0
        assert all(info.loads == 0 and info.device_bytes == 0 for info in infos if info is not owner)

    # The replicas' own counters agree: each served exactly the requests of the adapters it owns, loaded each of
    # those once (one device-tier miss) and holds them on its device tier.
    owned = [sum(1 for r in owners.values() if r == i) for i in range(REPLICAS)]
    assert deltas(before, after, "generate") == [per_adapter * n for n in owned]
    assert deltas(before, after, "device_misses") == owned
    assert deltas(before, after, "device_resident") == owned
    # Twelve adapters on one replica out of three would mean no hashing at all (chance ~ 3 / 3**12).
    assert sum(1 for n in owned if n > 0) >= 2, f"adapters per replica: {owned}"


@pytest.mark.slow
def test_nginx_spreads_base_model_requests(replicas: list[Replica], nginx: str) -> None:
    """No adapter, no cache to keep hot: the empty header is replaced by a per-request key."""
    before = counters(replicas)
    with Client(nginx, timeout=60) as client:
        generate(client, 15)
    served = deltas(before, counters(replicas), "generate")
    assert sum(served) == 15
    assert sum(1 for n in served if n > 0) >= 2, f"base-model requests per replica: {served}"


@pytest.mark.slow
def test_nginx_passes_grpc_errors_through(replicas: list[Replica], nginx: str) -> None:
    """A status from the replica (NOT_FOUND for an unknown adapter) reaches the client unchanged."""
    with Client(nginx, timeout=30) as client, pytest.raises(NotFound):
        client.generate("Hello", adapter="no-such-adapter", max_new_tokens=2)
