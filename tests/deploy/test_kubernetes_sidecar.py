"""deploy/k8s/overlays/sidecar: each worker pod runs an edge bound to its own worker, and an
InferencePool makes those pods the endpoints of an inference gateway. Rendered with the real
kustomize, validated offline: Kubernetes' own kinds against the Kubernetes OpenAPI schemas
(strict), the InferencePool against the v1 fields of its CRD (written down below), and the
pieces cross-checked against the services' own settings parsers.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest

from tests.deploy.manifests import SIDECAR_KUSTOMIZATION, find, parse_service, render_directory, settings_of
from tests.deploy.test_kubernetes import NEWEST_K8S, OLDEST_K8S, _schema_errors

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
# The InferencePool v1 fields this deployment may use, as the CRD
# (kubernetes-sigs/gateway-api-inference-extension, config/crd/bases/
# inference.networking.k8s.io_inferencepools.yaml) defines them: selector with matchLabels only,
# 1 to 8 target ports by number, appProtocol http or kubernetes.io/h2c, and an endpoint picker
# reference (name required; a port when the kind is a Service, the default kind; failure mode
# FailOpen or FailClose). Unknown fields fail, as a strict API server's would.
INFERENCE_POOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": INFERENCE_POOL_API},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "additionalProperties": {"type": "string", "maxLength": 63},
                        }
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "uniqueItems": True,
                    "items": {
                        "type": "object",
                        "required": ["number"],
                        "additionalProperties": False,
                        "properties": {"number": _PORT},
                    },
                },
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string", "pattern": "^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {
                            "type": "object",
                            "required": ["number"],
                            "additionalProperties": False,
                            "properties": {"number": _PORT},
                        },
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    # "port is required when kind is 'Service' or unspecified"
                    "if": {
                        "not": {"properties": {"kind": {"not": {"const": "Service"}}}, "required": ["kind"]}
                    },
                    "then": {"required": ["port"]},
                },
            },
        },
    },
}


def _pool_errors(pool: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(INFERENCE_POOL_SCHEMA)
    return [f"{'/'.join(map(str, e.path)) or '(top)'}: {e.message}" for e in validator.iter_errors(pool)]


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render_directory(SIDECAR_KUSTOMIZATION)


def _containers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    worker = find(objects, "Deployment", "sluice-worker")
    return {c["name"]: c for c in worker["spec"]["template"]["spec"]["containers"]}


def _env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str | None]:
    """Every variable a container gets: its ConfigMaps' literals, then its own ``env``."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        config_map = find(objects, "ConfigMap", source["configMapRef"]["name"])
        env.update(config_map.get("data", {}))
    for entry in container.get("env", []):
        env[entry["name"]] = entry.get("value")
    return env


def _settings(objects: list[dict[str, Any]], service: str, tmp_path) -> Any:
    env = {k: v for k, v in _env(objects, _containers(objects)[service]).items() if v is not None}
    known = settings_of(service)
    assert set(env) <= set(known), f"{service}: not settings: {sorted(set(env) - set(known))}"
    if "SLUICE_EDGE_API_KEYS_FILE" in env:  # a Secret volume at run time
        stand_in = tmp_path / "keys"
        stand_in.write_text("")
        env["SLUICE_EDGE_API_KEYS_FILE"] = str(stand_in)
    return parse_service(service, env)


def test_every_object_is_valid(objects):
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == [
        "ConfigMap",
        "ConfigMap",
        "Deployment",
        "InferencePool",
        "PodDisruptionBudget",
        "Service",
    ]
    problems = [
        problem
        for version in (OLDEST_K8S, NEWEST_K8S)
        for obj in objects
        if obj["apiVersion"] != INFERENCE_POOL_API and (problem := _schema_errors(obj, version))
    ]
    pool = find(objects, "InferencePool", "sluice")
    problems += _pool_errors(pool)
    assert not problems, "\n".join(problems)
    print(
        f"sidecar: {len(objects)} objects valid "
        f"(Kubernetes {OLDEST_K8S} and {NEWEST_K8S}; {INFERENCE_POOL_API})"
    )


def test_the_pool_schema_check_rejects_broken_pools(objects):
    pool = find(objects, "InferencePool", "sluice")
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = [{"port": 8080}]  # v1 names it "number"
    assert _pool_errors(broken)
    broken = copy.deepcopy(pool)
    broken["spec"]["selector"] = {"matchExpressions": []}  # v1 takes matchLabels only
    assert _pool_errors(broken)
    broken = copy.deepcopy(pool)
    del broken["spec"]["endpointPickerRef"]["port"]  # a Service reference needs its port
    assert _pool_errors(broken)
    broken["spec"]["endpointPickerRef"]["kind"] = "Other"  # ... another kind does not
    assert not _pool_errors(broken)


def test_the_pool_selects_the_worker_pods_and_targets_their_edge(objects, tmp_path):
    pool = find(objects, "InferencePool", "sluice")
    worker = find(objects, "Deployment", "sluice-worker")
    pod_labels = worker["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    edge = _settings(objects, "edge", tmp_path)
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [edge.port]
    assert pool["spec"]["appProtocol"] == "http"
    container_ports = {p["containerPort"] for p in _containers(objects)["edge"]["ports"]}
    assert edge.port in container_ports
    assert edge.host == "0.0.0.0", "the gateway reaches the edge on the pod's address"
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["name"] and picker["port"]["number"] == 9002  # the picker's ext-proc port


def test_each_pod_runs_a_worker_and_an_edge_bound_to_it(objects, tmp_path):
    assert set(_containers(objects)) == {"worker", "edge"}
    worker = _settings(objects, "worker", tmp_path)
    edge = _settings(objects, "edge", tmp_path)
    assert edge.workers == (f"127.0.0.1:{worker.port}",) and edge.worker_dns is None
    assert worker.metrics_names == "both", "the endpoint picker reads vLLM's names"
    # No central edge fleet is left behind.
    assert not [o for o in objects if "sluice-edge" in o["metadata"]["name"] and o["kind"] != "ConfigMap"]
    deployment = find(objects, "Deployment", "sluice-worker")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == worker.resolved_metrics_port
    assert annotations["kubectl.kubernetes.io/default-container"] == "worker"
    edge_container = _containers(objects)["edge"]
    assert edge_container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": edge.port}
    assert edge_container["livenessProbe"]["httpGet"] == {"path": "/health", "port": edge.port}
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= edge.drain_delay_s + edge.graceful_timeout_s + 5
    assert grace >= worker.grace_period + 5
    mounts = {m["mountPath"] for m in edge_container["volumeMounts"]}
    assert "/etc/sluice/api-keys" in mounts
