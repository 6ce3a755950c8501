"""deploy/k8s/overlays/lora: worker pods mount the adapters' PEFT folders read-only from a
ReadOnlyMany claim and serve them with --enable-lora --lora-modules; the edges allow runtime
loading. Rendered with the real kustomize, validated offline against the Kubernetes schemas
(strict), and the settings read back with the services' own parsers."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.manifests import (
    LORA_KUSTOMIZATION,
    container_env,
    container_of,
    deployments,
    find,
    parse_service,
    render_directory,
)
from tests.deploy.test_kubernetes import NEWEST_K8S, OLDEST_K8S, _schema_errors


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render_directory(LORA_KUSTOMIZATION)


def settings(objects: list[dict[str, Any]], service: str, keys: Path | None = None) -> Any:
    """The service's settings from its container's literal environment (``keys``: an empty
    stand-in for the edge's API-keys file, a Secret volume at run time)."""
    deployment = deployments(objects)[service]
    env = {name: value for name, value, _ in container_env(objects, deployment) if value is not None}
    if keys is not None:
        keys.write_text("")
        env["SLUICE_EDGE_API_KEYS_FILE"] = str(keys)
    return parse_service(service, env)


def test_every_object_matches_the_kubernetes_schemas(objects):
    problems = [_schema_errors(obj, v) for v in (OLDEST_K8S, NEWEST_K8S) for obj in objects]
    assert [p for p in problems if p] == []


def test_each_served_adapter_is_a_folder_on_the_read_only_adapters_volume(objects):
    worker = settings(objects, "worker")
    assert worker.enable_lora and worker.lora_modules and worker.problems() == []
    deployment = deployments(objects)["worker"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = container_of(deployment)["volumeMounts"]
    [adapters] = [m for m in mounts if "persistentVolumeClaim" in volumes[m["name"]]]
    assert adapters["readOnly"] is True
    claim = volumes[adapters["name"]]["persistentVolumeClaim"]
    assert claim["readOnly"] is True
    pvc = find(objects, "PersistentVolumeClaim", claim["claimName"])
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]  # every worker pod, on any node, reads it
    root = adapters["mountPath"]
    for module in worker.lora_modules:
        path = posixpath.normpath(module.path)
        assert posixpath.commonpath([path, root]) == root and path != root, module
    # No other mount shadows the adapters' folder.
    assert all(posixpath.commonpath([m["mountPath"], root]) != root for m in mounts if m is not adapters)


def test_the_edges_allow_runtime_loading(objects, tmp_path):
    assert settings(objects, "edge", tmp_path / "keys").allow_runtime_lora is True
