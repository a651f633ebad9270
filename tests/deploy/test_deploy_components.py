"""The optional kustomize components in deploy/k8s/components, each rendered on the cpu overlay (and all together).

Every rendered built-in object passes kubernetes-validate strictly. Beyond the schema: the TLS files the server is
told about sit in the mounted Secrets under the keys those Secrets have; the prometheus-adapter rule serves the
metric the HPA asks for, from a gauge the server declares, with a query that parses; the model volume's Job writes
the folder the server reads, with the real CLI; the adapters image replaces the shared volume. None adds an init
container or a download at pod start.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import promql_parser
import pytest
import yaml
from support.deploy import K8S_VERSIONS, one, pod_spec, render, server_container

from service.api.server import GENERATION_SERVICE
from service.cli import build_parser
from service.config import Settings
from service.metrics import REGISTRY

PROBES = {"startupProbe": GENERATION_SERVICE, "readinessProbe": GENERATION_SERVICE, "livenessProbe": ""}

Obj = dict[str, Any]
COMPONENTS = ("tls", "mtls", "prometheus-adapter", "model-volume", "adapters-image")
# Every minor the base is validated at; the adapters-image component's `image` volume source exists since 1.31.
VERSIONS = {name: K8S_VERSIONS for name in COMPONENTS}
VERSIONS["adapters-image"] = tuple(v for v in K8S_VERSIONS if int(v.split(".")[1]) >= 31)
# Server settings the edge branch adds (TLS, the API key file); until it merges they are not Settings fields.
TLS_VARIABLES = {"LORAPLEX_TLS_CERT", "LORAPLEX_TLS_KEY", "LORAPLEX_TLS_CLIENT_CA", "LORAPLEX_API_KEY_FILE"}


def config(docs: list[Obj]) -> dict[str, str]:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "loraplex-config"]
    data: dict[str, str] = cm["data"]
    return data


def mount_of(docs: list[Obj], path: Path) -> tuple[Obj, Obj]:
    """(volumeMount, volume) of the server container holding ``path``."""
    spec, container = pod_spec(docs), server_container(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container["volumeMounts"]:
        if path.is_relative_to(mount["mountPath"]):
            return mount, volumes[mount["name"]]
    raise AssertionError(f"{path} is on no volume of the server container")


@pytest.mark.parametrize("component", COMPONENTS)
def test_component_renders_and_validates(tmp_path: Path, component: str) -> None:
    docs = render(tmp_path, *(("tls", component) if component == "mtls" else (component,)))
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        for version in VERSIONS[component]:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{component}: {doc['kind']} invalid for {version}: {exc.message} at {list(exc.path)}")
    assert "initContainers" not in pod_spec(docs)


def test_all_components_together(tmp_path: Path) -> None:
    docs = render(tmp_path, *COMPONENTS)
    assert "initContainers" not in pod_spec(docs)
    known = {f"LORAPLEX_{name.upper()}" for name in Settings.__dataclass_fields__}
    assert set(config(docs)) <= known


def test_tls_files_are_in_the_mounted_secrets(tmp_path: Path) -> None:
    docs = render(tmp_path, "tls", "mtls")
    data = config(docs)
    assert set(data) >= TLS_VARIABLES
    for variable, key in (("LORAPLEX_TLS_CERT", "tls.crt"), ("LORAPLEX_TLS_KEY", "tls.key")):
        path = Path(data[variable])
        mount, volume = mount_of(docs, path)
        # A kubernetes.io/tls Secret holds tls.crt and tls.key; all of it is mounted, read-only.
        assert volume["secret"]["secretName"] == "loraplex-tls" and path.name == key and mount["readOnly"]
        assert path.parent == Path(mount["mountPath"])
    keys = Path(data["LORAPLEX_API_KEY_FILE"])
    mount, volume = mount_of(docs, keys)
    assert mount["readOnly"] and volume["secret"]["secretName"] == "loraplex-api-key-file"
    # Keys from the file only: the base's LORAPLEX_API_KEYS Secret (keys in the environment) is dropped.
    assert [e for e in server_container(docs)["envFrom"] if "secretRef" in e] == []
    assert [Path(mount["mountPath"]) / i["path"] for i in volume["secret"]["items"]] == [keys]
    ca = Path(data["LORAPLEX_TLS_CLIENT_CA"])
    mount, volume = mount_of(docs, ca)
    assert [Path(mount["mountPath"]) / i["path"] for i in volume["configMap"]["items"]] == [ca]
    for _, volume in (mount_of(docs, Path(data[v])) for v in ("LORAPLEX_TLS_KEY", "LORAPLEX_API_KEY_FILE")):
        assert volume["secret"]["defaultMode"] == 0o440  # group (fsGroup) read, nobody else
    # The base (no component) has none of it: it keeps working without the Secrets.
    plain = tmp_path / "plain"
    plain.mkdir()
    assert not TLS_VARIABLES & set(config(render(plain)))


def flags(command: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a command line (every flag of `loraplex health` takes a value)."""
    rest = command[2:]
    assert len(rest) % 2 == 0 and all(f.startswith("--") for f in rest[::2]), command
    return dict(zip(rest[::2], rest[1::2], strict=True))


@pytest.mark.parametrize("components", [("tls",), ("tls", "mtls")], ids=["tls", "mtls"])
def test_tls_probes_run_loraplex_health(tmp_path: Path, components: tuple[str, ...]) -> None:
    """Kubelet's gRPC probes cannot speak TLS: exec probes with the edge branch's `loraplex health` replace them,
    against the same port and services as the base's probes, trusting the mounted CA (and, under mTLS, presenting
    the mounted certificate). Each command parses with the real ``build_parser()``."""
    docs = render(tmp_path, *components)
    container, data = server_container(docs), config(docs)
    port = int(data["LORAPLEX_PORT"])
    for probe, service in PROBES.items():
        spec = container[probe]
        assert "grpc" not in spec and spec["timeoutSeconds"] >= 5, probe
        command = spec["exec"]["command"]
        assert command[:2] == ["loraplex", "health"], probe
        given = flags(command)
        assert given["--target"] == f"127.0.0.1:{port}" and given.get("--service", "") == service, probe
        _, ca_volume = mount_of(docs, Path(given["--tls-ca"]))
        assert ca_volume["secret"]["secretName"] == "loraplex-tls" and given["--tls-server-name"]
        if "mtls" in components:
            assert (given["--tls-cert"], given["--tls-key"]) == (data["LORAPLEX_TLS_CERT"], data["LORAPLEX_TLS_KEY"])
        else:
            assert "--tls-cert" not in given
        assert float(given["--timeout"]) < spec["timeoutSeconds"]
        args = build_parser().parse_args(command[1:])  # the real `loraplex health` takes exactly these flags
        assert args.command == "health" and args.target == given["--target"] and args.service == service
        assert str(args.tls_ca) == given["--tls-ca"] and args.tls_server_name == given["--tls-server-name"]
        assert (args.tls_cert is None) == ("mtls" not in components)


def test_prometheus_adapter_rule_serves_the_hpa_metric(tmp_path: Path) -> None:
    docs = render(tmp_path, "prometheus-adapter")
    (rules_cm,) = [d for d in docs if d["metadata"]["name"] == "loraplex-prometheus-adapter"]
    (rule,) = yaml.safe_load(rules_cm["data"]["config.yaml"])["rules"]
    (metric,) = one(docs, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    series = re.match(r"(\w+)\{", rule["seriesQuery"])
    assert series is not None
    gauges = {m.name for m in REGISTRY.collect() if m.type == "gauge"}
    assert series.group(1) in gauges
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    query = rule["metricsQuery"].replace("<<.Series>>", series.group(1)).replace("<<.LabelMatchers>>", 'pod="p"')
    promql_parser.parse(query)


def test_model_volume_job_writes_what_the_server_reads(tmp_path: Path) -> None:
    docs = render(tmp_path, "model-volume")
    model = Path(config(docs)["LORAPLEX_MODEL"])
    mount, volume = mount_of(docs, model)
    assert mount["readOnly"] and volume["persistentVolumeClaim"]["readOnly"]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert claim in {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    job = one(docs, "Job")["spec"]["template"]["spec"]
    (fill,) = job["containers"]
    args = build_parser().parse_args(fill["command"][1:])
    assert fill["command"][0] == "loraplex" and args.command == "fetch-model" and args.output == model
    job_volumes = {v["name"]: v for v in job["volumes"]}
    (job_mount,) = [m for m in fill["volumeMounts"] if model.is_relative_to(m["mountPath"])]
    assert job_volumes[job_mount["name"]]["persistentVolumeClaim"]["claimName"] == claim
    assert job["automountServiceAccountToken"] is False and job["securityContext"]["runAsNonRoot"] is True
    assert fill["image"].startswith("loraplex-convert:")


def test_adapters_image_replaces_the_shared_volume(tmp_path: Path) -> None:
    docs = render(tmp_path, "adapters-image")
    assert "PersistentVolumeClaim" not in {d["kind"] for d in docs}
    _, volume = mount_of(docs, Path("/adapters/x"))
    assert set(volume) == {"name", "image"} and volume["image"]["reference"]
