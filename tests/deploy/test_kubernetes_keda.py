"""deploy/k8s/overlays/keda: the workers autoscaled by a KEDA ScaledObject on queue depth and KV
use, to zero and back through the edges' wait-for-load. Rendered with the real kustomize, validated
offline: Kubernetes' own kinds against their schemas (strict), the ScaledObject against the
v1alpha1 fields of KEDA's CRD it may use (written down below), its queries against the metric
names the services really expose, and the edges' settings with their real parser."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import jsonschema
import pytest

from edge.metrics import EdgeMetrics
from tests.deploy.manifests import KEDA_KUSTOMIZATION, find, parse_service, render_directory
from tests.deploy.test_kubernetes import NEWEST_K8S, OLDEST_K8S, _schema_errors
from worker import metrics
from worker.engine.stats import EngineCounters, EngineStats

_NUMBER_TEXT = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"}
# The ScaledObject fields this deployment may use, as KEDA's CRD (kedacore/keda,
# config/crd/bases/keda.sh_scaledobjects.yaml) defines them; the prometheus trigger's metadata
# keys as its scaler reads them (values are strings). Unknown fields fail.
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {"name": {"type": "string"}, "kind": {"type": "string"}},
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"horizontalPodAutoscalerConfig": {"type": "object"}},
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"const": "prometheus"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "metadata": {
                                "type": "object",
                                "required": ["serverAddress", "query", "threshold"],
                                "additionalProperties": False,
                                "properties": {
                                    "serverAddress": {"type": "string", "pattern": "^https?://"},
                                    "query": {"type": "string"},
                                    "threshold": _NUMBER_TEXT,
                                    "activationThreshold": _NUMBER_TEXT,
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
_PROMQL_WORDS = {"sum", "avg", "max", "min", "rate", "or", "vector", "by", "status"}


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render_directory(KEDA_KUSTOMIZATION)


def _scaled_object(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "ScaledObject", "sluice-worker")


def test_every_object_is_valid(objects):
    errors = [
        error
        for obj in objects
        if obj["kind"] != "ScaledObject"
        for version in (OLDEST_K8S, NEWEST_K8S)
        if (error := _schema_errors(obj, version))
    ]
    assert not errors, "\n".join(errors)
    validator = jsonschema.Draft202012Validator(SCALED_OBJECT_SCHEMA)
    assert not [e.message for e in validator.iter_errors(_scaled_object(objects))]


def test_the_schema_check_rejects_an_unknown_field(objects):
    broken = _scaled_object(objects)
    broken["spec"]["triggers"][0]["metadata"]["treshold"] = "8"
    assert list(jsonschema.Draft202012Validator(SCALED_OBJECT_SCHEMA).iter_errors(broken))


def test_keda_owns_the_worker_count_down_to_zero(objects):
    scaled = _scaled_object(objects)["spec"]
    worker = find(objects, "Deployment", scaled["scaleTargetRef"]["name"])
    assert "nvidia.com/gpu" in str(worker["spec"]["template"])  # the GPU workers, not the edges
    assert "replicas" not in worker["spec"]  # an apply would reset KEDA's count
    assert scaled["minReplicaCount"] == 0 < scaled["maxReplicaCount"]
    assert [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"] == [
        find(objects, "HorizontalPodAutoscaler", "sluice-edge")  # KEDA makes the workers' own
    ]


def _exposed_names() -> str:
    """The metric names the worker (both namings) and the edge expose, as exposition text."""
    stats = EngineStats(0, 0, 0, 0, 0, 0, 0, EngineCounters())
    worker = metrics.render(stats, "m", metrics.MetricNames.BOTH)

    class NoWorkers:
        async def health(self) -> list[Any]:
            return []

    return worker + asyncio.run(EdgeMetrics().render(NoWorkers()))


def _metric_names(query: str) -> set[str]:
    """The metric names a PromQL query reads (label values and ranges left out)."""
    bare = re.sub(r'"[^"]*"|\[[^]]*\]', "", query)
    return set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare)) - _PROMQL_WORDS


def test_queries_name_metrics_the_services_expose(objects):
    triggers = {
        t["name"]: _metric_names(t["metadata"]["query"]) for t in _scaled_object(objects)["spec"]["triggers"]
    }
    exposed = _exposed_names()
    for trigger, names in triggers.items():
        for name in names:
            assert f"# TYPE {name} " in exposed, f"{trigger}: no service exposes {name}"
    # Sluice's names and their vLLM aliases (--metrics-names), for queue depth and KV use.
    assert triggers["queue-depth"] == {"sluice_worker_queue_depth", "vllm:num_requests_waiting"}
    assert triggers["kv-cache-usage"] == {"sluice_worker_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"}
    assert triggers["edge-no-worker"] == {"sluice_edge_requests_total"}  # wakes the first worker


def test_edges_wait_for_the_first_worker_after_zero(objects, tmp_path):
    assert find(objects, "Service", "sluice-worker")["spec"]["publishNotReadyAddresses"] is True
    edge_config = next(
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("sluice-edge")
    )
    settings = parse_service("edge", edge_config["data"])  # every variable a real, valid setting
    assert settings.wait_for_load_s >= 300  # a cold GPU pod: node, image, model load
    assert settings.request_timeout_s > settings.wait_for_load_s
