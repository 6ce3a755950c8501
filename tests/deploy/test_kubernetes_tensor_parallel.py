"""deploy/k8s/overlays/tensor-parallel: each model copy a LeaderWorkerSet group over several hosts,
the leader running rank 0 behind the worker Service, the other pods the remaining ranks. Rendered
with the real kustomize, validated offline: Kubernetes' own kinds (and the group's pod templates,
as pods) against the Kubernetes OpenAPI schemas (strict), each pod's settings with the worker's
real parser as its command completes them."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.deploy.manifests import DEPLOY, find, parse_service, render_directory, settings_of
from tests.deploy.test_kubernetes import NEWEST_K8S, OLDEST_K8S, _schema_errors

OVERLAY = DEPLOY / "k8s" / "overlays" / "tensor-parallel"


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render_directory(OVERLAY)


def group(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "LeaderWorkerSet", "sluice-worker-group")["spec"]["leaderWorkerTemplate"]


def pod_settings(objects: list[dict[str, Any]], template: dict[str, Any], worker_index: int) -> Any:
    """The worker's settings in one of the group's pods: its ConfigMap, its env, and what its
    ``sh -c`` command sets from the variables the LeaderWorkerSet controller gives it."""
    container = template["spec"]["containers"][0]
    config_map = container["envFrom"][0]["configMapRef"]["name"]
    env = dict(find(objects, "ConfigMap", config_map)["data"])
    env.update({item["name"]: item["value"] for item in container["env"] if "value" in item})
    script = container["command"][-1]
    lws = {
        "LWS_LEADER_ADDRESS": "sluice-worker-group-0.sluice-worker-group",
        "LWS_WORKER_INDEX": str(worker_index),
    }
    for name, value in re.findall(r"(SLUICE_WORKER_\w+)=(\S+)", script):
        assert name in settings_of("worker"), name
        env[name] = re.sub(r"\$(\w+)", lambda match: lws[match.group(1)], value)
    return parse_service("worker", env)


@pytest.mark.parametrize("version", [OLDEST_K8S, NEWEST_K8S])
def test_the_kinds_and_the_groups_pods_are_valid(objects: list[dict[str, Any]], version: str) -> None:
    errors = [_schema_errors(obj, version) for obj in objects if obj["kind"] != "LeaderWorkerSet"]
    for role in ("leaderTemplate", "workerTemplate"):
        template = group(objects)[role]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": role.lower()},
            "spec": template["spec"],
        }
        errors.append(_schema_errors(pod, version))
    assert [error for error in errors if error] == []


def test_every_pod_of_a_group_is_one_node_of_its_ranks(objects: list[dict[str, Any]]) -> None:
    spec = group(objects)
    leader = pod_settings(objects, spec["leaderTemplate"], 0)
    assert leader.nnodes == spec["size"] and leader.node_rank == 0 and leader.problems() == []
    assert leader.tensor_parallel_size % leader.nnodes == 0
    for index in range(1, spec["size"]):
        follower = pod_settings(objects, spec["workerTemplate"], index)
        assert follower.node_rank == index and follower.problems() == []
        assert (follower.tensor_parallel_size, follower.nnodes) == (
            leader.tensor_parallel_size,
            leader.nnodes,
        )
        assert (
            follower.dist_init_addr
            == leader.dist_init_addr
            == "sluice-worker-group-0.sluice-worker-group:29500"
        )
    assert spec["restartPolicy"] == "RecreateGroupOnPodRestart"
    ports = {port["containerPort"] for port in spec["leaderTemplate"]["spec"]["containers"][0]["ports"]}
    assert 29500 in ports


def test_only_the_leaders_serve_behind_the_worker_service(objects: list[dict[str, Any]]) -> None:
    assert not [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "sluice-worker"]
    selector = find(objects, "Service", "sluice-worker")["spec"]["selector"]
    spec = group(objects)
    leader_labels = spec["leaderTemplate"]["metadata"]["labels"]
    worker_labels = spec["workerTemplate"]["metadata"]["labels"]
    assert selector.items() <= leader_labels.items()
    assert not selector.items() <= worker_labels.items()
