"""components/inference-pool: loraplex behind the Gateway API Inference Extension (v1.5.0), rendered on the cpu
overlay with the real ``kubectl kustomize``.

The built-in objects (the endpoint picker's Deployment, Service, ServiceAccount, RBAC, ConfigMap, NetworkPolicy)
pass kubernetes-validate strictly. The InferencePool and InferenceObjective, whose schemas that tool lacks, are
checked field by field against the CRDs of that release as modelled in POOL_SPEC / OBJECTIVE_SPEC: required
fields, types, enums and bounds, no unknown field at any level. Beyond the schema: the pool selects exactly the
server pods at the server's HTTP port (``Settings`` defaults, never retyped), its endpoint picker reference
resolves to the EPP Service and through it to the EPP container, and the gauges the EPP is told to read are
gauges ``service.metrics`` declares.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.deploy import K8S_VERSIONS, Obj, one, render

from service.config import Settings
from service.metrics import REGISTRY

COMPONENT = "inference-pool"
DEFAULTS = Settings()
POOL_API = "inference.networking.k8s.io/v1"
OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"
EPP_CONFIG_API = "inference.networking.x-k8s.io/v1alpha1"
CRD_APIS = {"InferencePool": POOL_API, "InferenceObjective": OBJECTIVE_API}
# Flags of the v1.5.0 EPP these manifests may pass (a typo would stop the picker at start-up).
EPP_FLAGS = {"pool-name", "pool-namespace", "pool-group", "config-file", "model-server-metrics-port"}
EPP_FLAGS |= {"metrics-endpoint-auth", "tracing", "zap-encoder", "v"}

# The CRDs' spec schemas (GIE v1.5.0 config/crd/bases), as far as these manifests use them. A node: "type", then
# optional "required", "properties" (closed: nothing else allowed), "values" (a map's value schema), "items",
# "enum", "pattern", "minimum"/"maximum", "minLength"/"maxLength", "minItems"/"maxItems", "minProperties"/...
DNS_SUBDOMAIN_OR_EMPTY = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
KIND_PATTERN = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
LABEL_VALUE = {"type": str, "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
PORT = {"type": dict, "required": {"number"}, "properties": {"number": {"type": int, "minimum": 1, "maximum": 65535}}}
# A reference to another object (the pool's picker, the objective's pool): the fields both CRDs share.
REFERENCE: Obj = {
    "group": {"type": str, "maxLength": 253, "pattern": DNS_SUBDOMAIN_OR_EMPTY},
    "kind": {"type": str, "minLength": 1, "maxLength": 63, "pattern": KIND_PATTERN},
    "name": {"type": str, "minLength": 1, "maxLength": 253},
}
POOL_SPEC: Obj = {
    "type": dict,
    "required": {"selector", "targetPorts", "endpointPickerRef"},
    "properties": {
        "selector": {
            "type": dict,
            "required": {"matchLabels"},
            "properties": {
                "matchLabels": {"type": dict, "values": LABEL_VALUE, "minProperties": 1, "maxProperties": 64},
            },
        },
        "targetPorts": {"type": list, "items": PORT, "minItems": 1, "maxItems": 8},
        "appProtocol": {"type": str, "enum": {"http", "kubernetes.io/h2c"}},
        "endpointPickerRef": {
            "type": dict,
            "required": {"name"},
            "properties": {
                **REFERENCE,
                "port": PORT,
                "failureMode": {"type": str, "enum": {"FailOpen", "FailClose"}},
            },
        },
    },
}
OBJECTIVE_SPEC: Obj = {
    "type": dict,
    "required": {"poolRef"},
    "properties": {
        "poolRef": {
            "type": dict,
            "required": {"name"},
            "properties": {
                **REFERENCE,
            },
        },
        "priority": {"type": int},
    },
}
SPECS = {"InferencePool": POOL_SPEC, "InferenceObjective": OBJECTIVE_SPEC}
METADATA_FIELDS = {"name", "namespace", "labels", "annotations"}
BOUNDS = (
    ("minimum", "maximum"),
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
)


def schema_errors(value: Any, node: Obj, path: str) -> list[str]:
    """What in ``value`` the schema ``node`` rejects, each with its path."""
    kind: type = node["type"]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        return [f"{path}: {value!r} is not {kind.__name__}"]
    errors: list[str] = []
    size = value if isinstance(value, int) else len(value)  # a node only has the bounds of its own type
    for low, high in BOUNDS:
        if (low in node or high in node) and not node.get(low, size) <= size <= node.get(high, size):
            errors.append(f"{path}: {size} outside [{node.get(low)}, {node.get(high)}]")
    if "enum" in node and value not in node["enum"]:
        errors.append(f"{path}: {value!r} not in {sorted(node['enum'])}")
    if "pattern" in node and not re.search(node["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {node['pattern']}")
    if isinstance(value, dict):
        errors += [f"{path}.{name}: required" for name in sorted(node.get("required", set()) - set(value))]
        for key, item in value.items():
            child = node["properties"].get(key) if "properties" in node else node.get("values")
            if child is None:
                errors.append(f"{path}.{key}: unknown field")
            else:
                errors += schema_errors(item, child, f"{path}.{key}")
    if isinstance(value, list):
        for index, item in enumerate(value):
            errors += schema_errors(item, node["items"], f"{path}[{index}]")
    return errors


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    return render(tmp_path_factory.mktemp("inference-pool"), COMPONENT)


def named(docs: list[Obj], kind: str, name: str) -> Obj:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def pool(docs: list[Obj]) -> Obj:
    return one(docs, "InferencePool")


def epp_container(docs: list[Obj]) -> Obj:
    (container,) = named(docs, "Deployment", "loraplex-epp")["spec"]["template"]["spec"]["containers"]
    return container


def epp_flags(docs: list[Obj]) -> dict[str, str]:
    """``--flag=value`` arguments of the EPP container."""
    args = epp_container(docs)["args"]
    assert all(a.startswith("--") and "=" in a for a in args), args
    flags = dict(a[2:].split("=", 1) for a in args)
    assert set(flags) <= EPP_FLAGS, set(flags) - EPP_FLAGS
    return flags


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_built_in_objects_validate_strictly(docs: list[Obj]) -> None:
    added = [d for d in docs if d["metadata"]["name"].startswith("loraplex-epp")]
    assert {d["kind"] for d in added} >= {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"}
    for doc in docs:
        if doc["kind"] in CRD_APIS or doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']} {doc['metadata']['name']} invalid for {version}: {exc.message}")


@pytest.mark.parametrize("kind", sorted(CRD_APIS))
def test_custom_resources_match_the_crds(docs: list[Obj], kind: str) -> None:
    doc = one(docs, kind)
    assert doc["apiVersion"] == CRD_APIS[kind]
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(doc["metadata"]) <= METADATA_FIELDS and doc["metadata"]["name"]
    assert schema_errors(doc["spec"], SPECS[kind], "spec") == []


def test_schema_check_rejects_what_the_crd_rejects(docs: list[Obj]) -> None:
    """The field-by-field check is not vacuous: an unknown field, a missing one, a bad enum, port 0 all fail."""
    spec = pool(docs)["spec"]
    broken = [
        {**spec, "targetPort": DEFAULTS.http_port},
        {k: v for k, v in spec.items() if k != "selector"},
        {**spec, "appProtocol": "grpc"},
        {**spec, "targetPorts": [{"number": 0}]},
        {**spec, "endpointPickerRef": {**spec["endpointPickerRef"], "namespace": "other"}},
    ]
    for case in broken:
        assert schema_errors(case, POOL_SPEC, "spec"), case


def test_pool_selects_the_server_pods_at_the_http_port(docs: list[Obj]) -> None:
    spec = pool(docs)["spec"]
    selector = spec["selector"]["matchLabels"]
    server = named(docs, "Deployment", "loraplex")["spec"]["template"]
    assert matches(selector, server["metadata"]["labels"])
    epp = named(docs, "Deployment", "loraplex-epp")["spec"]["template"]
    assert not matches(selector, epp["metadata"]["labels"])
    assert spec["targetPorts"] == [{"number": DEFAULTS.http_port}]
    (container,) = [c for c in server["spec"]["containers"] if c["name"] == "loraplex"]
    assert {"name": "http", "containerPort": DEFAULTS.http_port, "protocol": "TCP"} in container["ports"]
    assert spec.get("appProtocol", "http") == "http"  # the HTTP edge speaks HTTP/1.1


def test_endpoint_picker_reference_resolves_to_the_epp(docs: list[Obj]) -> None:
    ref = pool(docs)["spec"]["endpointPickerRef"]
    assert ref.get("group", "") == "" and ref.get("kind", "Service") == "Service" and "port" in ref
    service = named(docs, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    template = named(docs, "Deployment", "loraplex-epp")["spec"]["template"]
    assert matches(service["spec"]["selector"], template["metadata"]["labels"])
    assert port["targetPort"] in {p["name"] for p in epp_container(docs)["ports"]}
    flags = epp_flags(docs)
    assert flags["pool-name"] == pool(docs)["metadata"]["name"]
    assert flags["pool-group"] == POOL_API.split("/")[0]
    # The EPP scrapes the server's metrics port, which is not the pool's target port.
    assert int(flags["model-server-metrics-port"]) == DEFAULTS.metrics_port


def test_epp_account_may_watch_the_pool(docs: list[Obj]) -> None:
    account = named(docs, "Deployment", "loraplex-epp")["spec"]["template"]["spec"]["serviceAccountName"]
    assert account in {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    binding = one(docs, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = named(docs, "Role", binding["roleRef"]["name"])
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    pool_group, objective_group = POOL_API.split("/")[0], OBJECTIVE_API.split("/")[0]
    assert granted >= {("", "pods"), (pool_group, "inferencepools"), (objective_group, "inferenceobjectives")}
    assert all(set(rule["verbs"]) == {"get", "list", "watch"} for rule in role["rules"])


def test_objective_refers_to_the_pool(docs: list[Obj]) -> None:
    ref = one(docs, "InferenceObjective")["spec"]["poolRef"]
    assert ref.get("group", POOL_API.split("/")[0]) == POOL_API.split("/")[0]
    assert ref.get("kind", "InferencePool") == "InferencePool" and ref["name"] == pool(docs)["metadata"]["name"]


def picker_config(docs: list[Obj]) -> Obj:
    """The EndpointPickerConfig the EPP's --config-file names, read from the ConfigMap mounted there."""
    path = Path(epp_flags(docs)["config-file"])
    template = named(docs, "Deployment", "loraplex-epp")["spec"]["template"]["spec"]
    (mount,) = [m for m in epp_container(docs)["volumeMounts"] if path.parent == Path(m["mountPath"])]
    (volume,) = [v for v in template["volumes"] if v["name"] == mount["name"]]
    data = named(docs, "ConfigMap", volume["configMap"]["name"])["data"]
    config: Obj = yaml.safe_load(data[path.name])
    return config


def test_epp_reads_the_gauges_loraplex_serves(docs: list[Obj]) -> None:
    config = picker_config(docs)
    assert config["apiVersion"] == EPP_CONFIG_API and config["kind"] == "EndpointPickerConfig"
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    assert {ref["pluginRef"] for ref in profile["plugins"]} <= set(plugins)
    assert "lora-affinity-scorer" in {ref["pluginRef"] for ref in profile["plugins"]}
    source = plugins["metrics-data-source"]["parameters"]
    (scrape,) = one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert source == {"scheme": "http", "path": scrape["path"]}  # /metrics is plain HTTP, also under TLS
    extractor = plugins["core-metrics-extractor"]["parameters"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    gauges = {m.name for m in REGISTRY.collect() if m.type == "gauge"}
    for field in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec"):
        name = engine[field]
        assert name in gauges, f"{field}: {name} is no gauge of service.metrics"
    assert engine["cacheInfoSpec"] == ""  # loraplex has no cache-config gauge; empty turns it off


def admits(policy: Obj, pod_labels: dict[str, str], port: str) -> bool:
    """Whether a NetworkPolicy's ingress rules let pods with ``pod_labels`` (same namespace) reach ``port``."""
    for rule in policy["spec"].get("ingress", []):
        ports = {p["port"] for p in rule.get("ports", [])}
        peers = [peer["podSelector"].get("matchLabels", {}) for peer in rule.get("from", []) if "podSelector" in peer]
        if port in ports and any(matches(selector, pod_labels) for selector in peers):
            return True
    return False


def test_epp_may_scrape_the_server_pods(docs: list[Obj]) -> None:
    server = named(docs, "Deployment", "loraplex")["spec"]["template"]
    epp = named(docs, "Deployment", "loraplex-epp")["spec"]["template"]["metadata"]["labels"]
    (metrics,) = [p for c in server["spec"]["containers"] for p in c["ports"] if p["name"] == "metrics"]
    assert metrics["containerPort"] == DEFAULTS.metrics_port
    policies = [
        p
        for p in docs
        if p["kind"] == "NetworkPolicy"
        and matches(p["spec"]["podSelector"]["matchLabels"], server["metadata"]["labels"])
    ]
    assert any(admits(p, epp, "metrics") for p in policies)
    assert not any(admits(p, epp, "http") or admits(p, epp, "grpc") for p in policies)  # the picker only reads


def test_renders_with_every_other_component(tmp_path: Path) -> None:
    """Beside TLS, a model volume and an adapters image, the pool still selects the (patched) server pods."""
    docs = render(tmp_path, "tls", "mtls", "prometheus-adapter", "model-volume", "adapters-image", COMPONENT)
    server = named(docs, "Deployment", "loraplex")["spec"]["template"]["metadata"]["labels"]
    assert matches(pool(docs)["spec"]["selector"]["matchLabels"], server)
    assert schema_errors(pool(docs)["spec"], POOL_SPEC, "spec") == []
