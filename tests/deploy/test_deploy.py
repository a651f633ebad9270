"""Deployment artefacts against the server they deploy: Kubernetes manifests, Dockerfile, system-deps script.

The overlays are rendered with the real ``kubectl kustomize`` and every built-in object is validated strictly
(unknown fields rejected) with kubernetes-validate; the Prometheus Operator's PodMonitor, whose schema that tool
lacks, is checked field by field. Ports, health service names, flags, paths and user ids are compared with the
server's own definitions (``Settings`` defaults, ``GENERATION_SERVICE``, the CLI parser, the Dockerfile), never
retyped. Pods start from what the image ships: no init container, nothing fetched. The optional components are
tested in ``tests/deploy/test_deploy_components.py``, the Dockerfile's stages in ``tests/deploy/test_dockerfile.py``.
``scripts/system_deps.sh`` installs kubectl and promtool where they are missing.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from support.deploy import (
    K8S,
    K8S_VERSIONS,
    ROOT,
    Obj,
    dockerfile_entrypoint,
    dockerfile_instructions,
    dockerfile_user,
    find_kubectl,
    image_paths,
    one,
    pod_spec,
    server_container,
)

from service.api.server import GENERATION_SERVICE
from service.cli import build_parser
from service.config import Settings
from service.metrics import REGISTRY

OVERLAYS = ("cpu", "gpu")
# Not the bare names: conftest skips every test with a "gpu" keyword, and a parameter id is one.
OVERLAY_IDS = [f"{name}_overlay" for name in OVERLAYS]
CRD_GROUPS = ("monitoring.coreos.com/",)
DEFAULTS = Settings()


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    kubectl = find_kubectl()
    out: dict[str, list[Obj]] = {}
    for overlay in OVERLAYS:
        proc = subprocess.run(
            [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{proc.stderr}"
        assert "deprecated" not in proc.stderr.lower(), proc.stderr
        out[overlay] = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    return out


def config_data(docs: list[Obj]) -> dict[str, str]:
    data: dict[str, str] = one(docs, "ConfigMap")["data"]
    return data


def served_settings(docs: list[Obj]) -> Settings:
    """The Settings a pod runs with: the ConfigMap's variables, then the entrypoint's flags (which win)."""
    entry = build_parser().parse_args(dockerfile_entrypoint()[1:])
    flags = {k: v for k, v in vars(entry).items() if v is not None and k in Settings.__dataclass_fields__}
    return Settings.from_env(config_data(docs), **flags)


def container_ports(container: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


# --------------------------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_overlay_renders_every_object(rendered: dict[str, list[Obj]], overlay: str) -> None:
    kinds = sorted(d["kind"] for d in rendered[overlay])
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "HorizontalPodAutoscaler",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "PodMonitor",
            "Service",
            "ServiceAccount",
        ]
    )


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_builtin_objects_pass_strict_validation(rendered: dict[str, list[Obj]], overlay: str, version: str) -> None:
    for doc in rendered[overlay]:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"].startswith(CRD_GROUPS):
            # kubernetes-validate knows only built-in kinds; PodMonitor is checked by test_pod_monitor below.
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {name} invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}")


def test_strict_validation_catches_a_misspelled_field(rendered: dict[str, list[Obj]]) -> None:
    """The validator is strict for real: a typo in a probe is an error, not a silently ignored field."""
    deployment = copy.deepcopy(one(rendered["cpu"], "Deployment"))
    server_container([deployment])["readinesProbe"] = server_container([deployment]).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


# ------------------------------------------------------------------------------- the server's contract


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_probes_use_the_servers_port_and_health_services(rendered: dict[str, list[Obj]], overlay: str) -> None:
    container = server_container(rendered[overlay])
    settings = served_settings(rendered[overlay])
    assert container_ports(container) == {
        "grpc": settings.port,
        "http": settings.http_port,
        "metrics": settings.metrics_port,
    }
    assert (settings.port, settings.http_port, settings.metrics_port) == (
        DEFAULTS.port,
        DEFAULTS.http_port,
        DEFAULTS.metrics_port,
    )
    # Readiness and start-up: the generation service, NOT_SERVING while loading and while draining.
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": settings.port, "service": GENERATION_SERVICE}, probe
    # Liveness: the whole server ("" service): does the process answer at all.
    assert container["livenessProbe"]["grpc"]["port"] == settings.port
    assert container["livenessProbe"]["grpc"].get("service", "") == ""


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_startup_probe_allows_a_slow_model_load(rendered: dict[str, list[Obj]], overlay: str) -> None:
    probe = server_container(rendered[overlay])["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 300


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_termination_grace_covers_prestop_and_drain(rendered: dict[str, list[Obj]], overlay: str) -> None:
    docs = rendered[overlay]
    container = server_container(docs)
    grace = served_settings(docs).grace_seconds
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2
    pre_stop = float(command[1])
    assert pod_spec(docs)["terminationGracePeriodSeconds"] >= pre_stop + grace + 10
    # A draining pod reports NOT_SERVING on "" too: liveness must not kill it before the drain ends.
    liveness = container["livenessProbe"]
    assert liveness["failureThreshold"] * liveness["periodSeconds"] > pre_stop + grace


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_configmap_holds_real_settings(rendered: dict[str, list[Obj]], overlay: str) -> None:
    docs = rendered[overlay]
    fields = {f"LORAPLEX_{f.name.upper()}" for f in dataclasses.fields(Settings)}
    data = config_data(docs)
    assert set(data) <= fields, f"not Settings fields: {sorted(set(data) - fields)}"
    env_names = {e["name"] for e in server_container(docs)["env"]}
    assert {n for n in env_names if n.startswith("LORAPLEX_")} <= fields
    # The entrypoint sets the bind addresses; a ConfigMap value would be silently overridden by the flags.
    assert not {"LORAPLEX_HOST", "LORAPLEX_METRICS_HOST"} & set(data)
    settings = served_settings(docs)  # parses and validates every value
    assert settings.host == "0.0.0.0" and settings.metrics_host == "0.0.0.0"
    (ref,) = [e["configMapRef"]["name"] for e in server_container(docs)["envFrom"] if "configMapRef" in e]
    assert ref == one(docs, "ConfigMap")["metadata"]["name"]
    threads = next(e for e in server_container(docs)["env"] if e["name"] == "LORAPLEX_THREADS")
    assert threads["valueFrom"]["resourceFieldRef"]["containerName"] == "loraplex"


def test_overlays_pick_device_image_and_gpu(rendered: dict[str, list[Obj]]) -> None:
    cpu, gpu = served_settings(rendered["cpu"]), served_settings(rendered["gpu"])
    assert cpu.device == "cpu" and gpu.device == "cuda" and gpu.dtype == "bfloat16"
    cpu_c, gpu_c = server_container(rendered["cpu"]), server_container(rendered["gpu"])
    assert gpu_c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in json.dumps(cpu_c["resources"])
    assert cpu_c["image"].endswith(":0.1.0-cpu") and gpu_c["image"].endswith(":0.1.0-cuda")
    for docs in rendered.values():
        images = {c["image"] for c in pod_spec(docs)["containers"] + pod_spec(docs).get("initContainers", [])}
        assert len(images) == 1, images
    assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec(rendered["gpu"])["tolerations"])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_pods_start_from_what_the_image_ships(rendered: dict[str, list[Obj]], overlay: str) -> None:
    """No init container and no download: the model and the demo adapters are in the image, at the served paths."""
    docs = rendered[overlay]
    spec, settings = pod_spec(docs), served_settings(docs)
    assert "initContainers" not in spec
    shipped = image_paths()
    assert any(settings.model.is_relative_to(dest) for dest in shipped), (settings.model, shipped)
    demo = Path("/app/adapters/demo")
    assert shipped[str(demo)] == Path("adapters/demo") and (ROOT / "adapters" / "demo").is_dir()
    assert demo in settings.adapter_dirs
    # The server container relies on the image's entrypoint (its --host / --metrics-host flags).
    container = server_container(docs)
    assert "command" not in container and "args" not in container
    assert not [k for k in {d["kind"] for d in docs} if k in ("Job", "CronJob")]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_volumes_hold_the_adapters(rendered: dict[str, list[Obj]], overlay: str) -> None:
    docs = rendered[overlay]
    spec, container = pod_spec(docs), server_container(docs)
    settings = served_settings(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert set(mounts) <= set(volumes)
    assert all(m.get("readOnly") for name, m in mounts.items() if name != "tmp")
    assert Path(mounts["adapters"]["mountPath"]) in settings.adapter_dirs
    assert settings.adapter_roots == (Path(mounts["adapters"]["mountPath"]),)  # LoadAdapter: the shared volume only
    claim = volumes["adapters"]["persistentVolumeClaim"]["claimName"]
    assert claim in {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert mounts["tmp"]["mountPath"] == "/tmp" and "emptyDir" in volumes["tmp"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_service_account_mounts_no_token(rendered: dict[str, list[Obj]], overlay: str) -> None:
    docs = rendered[overlay]
    account = one(docs, "ServiceAccount")
    assert account["automountServiceAccountToken"] is False
    spec = pod_spec(docs)
    assert spec["serviceAccountName"] == account["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_replicas_spread_over_zones_and_nodes(rendered: dict[str, list[Obj]], overlay: str) -> None:
    docs = rendered[overlay]
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    spreads = {c["topologyKey"]: c for c in pod_spec(docs)["topologySpreadConstraints"]}
    assert set(spreads) == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
    for spread in spreads.values():
        assert spread["labelSelector"]["matchLabels"].items() <= pod_labels.items()
        assert spread["whenUnsatisfiable"] == "ScheduleAnyway" and spread["maxSkew"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_network_policy_admits_only_the_served_ports(rendered: dict[str, list[Obj]], overlay: str) -> None:
    docs = rendered[overlay]
    policy = one(docs, "NetworkPolicy")["spec"]
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"] and policy["egress"] == []
    ports = container_ports(server_container(docs))
    admitted = {}
    for rule in policy["ingress"]:
        assert rule["from"], "an ingress rule without `from` admits every source"
        for port in rule["ports"]:
            admitted[port["port"]] = rule["from"]
    assert set(admitted) == set(ports) == {"grpc", "http", "metrics"}
    # /metrics only from Prometheus' namespace; gRPC only from pods labelled as clients.
    (scraper,) = admitted["metrics"]
    assert scraper["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    (client,) = admitted["grpc"]
    assert client["podSelector"]["matchLabels"] == {"loraplex.io/client": "true"}
    assert admitted["http"] == admitted["grpc"]  # the HTTP API: the same clients as gRPC


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_service_is_headless_and_targets_the_pods(rendered: dict[str, list[Obj]], overlay: str) -> None:
    docs = rendered[overlay]
    service = one(docs, "Service")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = container_ports(server_container(docs))
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]] == port["port"], port


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_pod_monitor(rendered: dict[str, list[Obj]], overlay: str) -> None:
    docs = rendered[overlay]
    monitor = one(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = container_ports(server_container(docs))
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
    assert ports[endpoint["port"]] == served_settings(docs).metrics_port
    assert endpoint["path"] == "/metrics"
    assert re.fullmatch(r"\d+[smh]", endpoint["interval"])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_autoscaler_and_disruption_budget(rendered: dict[str, list[Obj]], overlay: str) -> None:
    docs = rendered[overlay]
    deployment, hpa, pdb = (
        one(docs, "Deployment"),
        one(docs, "HorizontalPodAutoscaler"),
        one(docs, "PodDisruptionBudget"),
    )
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    gauges = {m.name for m in REGISTRY.collect() if m.type == "gauge"}
    assert metric["pods"]["metric"]["name"] == "loraplex_waiting_requests" in gauges
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]
    # Rolling updates add a loaded pod before draining an old one.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_pods_run_as_the_images_user(rendered: dict[str, list[Obj]], overlay: str) -> None:
    security = pod_spec(rendered[overlay])["securityContext"]
    assert security["runAsNonRoot"] is True
    assert str(security["runAsUser"]) == dockerfile_user().split(":")[0]


# ------------------------------------------------------------------------------------------ Dockerfile


def test_dockerfile_base_ports_user_and_entrypoint() -> None:
    steps = dockerfile_instructions()
    assert steps[0] == ("ARG", "BASE=python:3.11-slim")
    assert ("FROM", "${BASE} AS python") in steps
    (exposed,) = [args for word, args in steps if word == "EXPOSE"]
    assert {int(p) for p in exposed.split()} == {DEFAULTS.port, DEFAULTS.http_port, DEFAULTS.metrics_port}
    assert dockerfile_user().split(":")[0] not in ("0", "root")
    entry = dockerfile_entrypoint()
    assert entry[0] == "loraplex"
    args = build_parser().parse_args(entry[1:])
    assert (args.command, args.host, args.metrics_host) == ("serve", "0.0.0.0", "0.0.0.0")


def test_dockerignore_keeps_local_venv_and_models_out() -> None:
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", "models", ".git"} <= ignored


def test_system_deps_script_parses() -> None:
    script = ROOT / "scripts" / "system_deps.sh"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
