"""deploy/compose*.yaml: valid Compose files (``compose-spec``, the Rust compose_spec parser,
which rejects unknown keys and bad durations), and consistent with the services' settings.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from compose_spec import PyCompose

from tests.deploy.manifests import (
    COMPOSE_FILES,
    REPO,
    compose_environment,
    compose_service_kind,
    duration_s,
    load_compose,
    parse_service,
    settings_of,
)

COMPOSE = COMPOSE_FILES[0]


def _validate(data: dict[str, Any]) -> None:
    """Raises ValueError naming the offending key when ``data`` is not a valid Compose file."""
    compose = PyCompose.from_json(json.dumps(data))
    compose.validate()
    compose.to_spec()


def _merged() -> dict[str, Any]:
    """compose.yaml with compose.gpu.yaml on top (maps merge, as `docker compose -f a -f b`)."""

    def merge(base: Any, override: Any) -> Any:
        if isinstance(base, dict) and isinstance(override, dict):
            return {k: merge(base.get(k), override[k]) if k in base else override[k] for k in override} | {
                k: v for k, v in base.items() if k not in override
            }
        return copy.deepcopy(override)

    return merge(load_compose(COMPOSE_FILES[0]), load_compose(COMPOSE_FILES[1]))


def _services(data: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    return {name: (compose_service_kind(s), s) for name, s in data["services"].items()}


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_files_are_valid(path: Path):
    _validate(load_compose(path))


def test_the_compose_check_rejects_a_misspelt_key():
    data = load_compose(COMPOSE)
    healthcheck = data["services"]["edge"]["healthcheck"]
    healthcheck["intervall"] = healthcheck.pop("interval")
    with pytest.raises(ValueError, match="intervall"):
        _validate(data)


def test_one_edge_in_front_of_two_workers():
    services = _services(load_compose(COMPOSE))
    kinds = sorted(kind for kind, _ in services.values())
    assert kinds == ["edge", "worker", "worker"]
    for kind, service in services.values():
        build = service["build"]
        assert (REPO / "deploy" / build["context"]).resolve() == REPO
        assert build["dockerfile"] == f"deploy/{kind}.Dockerfile"


@pytest.mark.parametrize("combined", [False, True], ids=["cpu", "gpu"])
def test_every_variable_is_a_real_setting_with_a_valid_value(combined):
    data = _merged() if combined else load_compose(COMPOSE)
    for name, (kind, service) in _services(data).items():
        env = compose_environment(service)
        known = settings_of(kind)
        for variable in env:
            assert variable in known, f"{name}: {variable} is not a setting of the {kind}"
        parse_service(kind, env)


def test_edge_reaches_every_worker_on_its_grpc_port():
    services = _services(load_compose(COMPOSE))
    (edge,) = [s for kind, s in services.values() if kind == "edge"]
    settings = parse_service("edge", compose_environment(edge))
    workers = {name: s for name, (kind, s) in services.items() if kind == "worker"}
    addresses = {tuple(address.rsplit(":", 1)) for address in settings.workers}
    expected = {
        (name, str(parse_service("worker", compose_environment(s)).port)) for name, s in workers.items()
    }
    assert addresses == expected
    for name in workers:
        assert edge["depends_on"][name] == {"condition": "service_healthy"}


def test_healthchecks_and_ports_agree_with_the_settings():
    for name, (kind, service) in _services(load_compose(COMPOSE)).items():
        settings = parse_service(kind, compose_environment(service))
        assert service["healthcheck"]["test"] == [
            "CMD",
            "sluice-healthcheck",
            "grpc" if kind == "worker" else "http",
        ]
        container_ports = {int(str(p).rsplit(":", 1)[1]) for p in service.get("ports", [])}
        expected = {settings.resolved_metrics_port} if kind == "worker" else {settings.port}
        assert container_ports == expected, f"{name}: published container ports"
        if kind == "edge":
            assert settings.host == "0.0.0.0"


def test_stop_grace_covers_the_drain():
    for name, (kind, service) in _services(load_compose(COMPOSE)).items():
        settings = parse_service(kind, compose_environment(service))
        needed = (
            settings.grace_period
            if kind == "worker"
            else settings.drain_delay_s + settings.graceful_timeout_s
        )
        assert duration_s(service["stop_grace_period"]) >= needed + 5, f"{name}: stop_grace_period"


def test_named_volumes_are_declared():
    data = load_compose(COMPOSE)
    for name, service in data["services"].items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in data.get("volumes", {}), f"{name}: volume {source} is not declared"
