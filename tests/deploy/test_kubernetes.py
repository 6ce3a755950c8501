"""deploy/k8s: rendered with the real kustomize (inside ``kubectl kustomize``), every object
validated offline against the Kubernetes OpenAPI schemas (``kubernetes-validate``, strict:
unknown fields fail), and the manifests cross-checked against the services' own settings.
"""

from __future__ import annotations

import copy
import posixpath
from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.manifests import (
    KUSTOMIZATIONS,
    container_env,
    container_of,
    deployments,
    find,
    parse_service,
    render,
    settings_of,
)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


# 1.27, the first release with native gRPC probes on by default (or the oldest schema bundled
# after it), and the newest schema bundled.
_BUNDLED = sorted(set(kubernetes_validate.utils.all_versions()), key=_release)
OLDEST_K8S = next((v for v in _BUNDLED if _release(v) >= (1, 27)), _BUNDLED[-1])
NEWEST_K8S = kubernetes_validate.utils.latest_version()
GPU = "nvidia.com/gpu"

pytestmark = pytest.mark.parametrize("overlay", sorted(KUSTOMIZATIONS))


def _schema_errors(obj: dict[str, Any], version: str) -> str | None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.utils.ValidationError as error:
        where = "/".join(str(p) for p in error.path) or "(top)"
        return f"{obj['kind']} {obj['metadata'].get('name')}: {where}: {error.message}"
    return None


def _effective_settings(objects: list[dict[str, Any]], service: str, tmp_path) -> Any:
    """Parses the container's literal environment with the service's real parser."""
    deployment = deployments(objects)[service]
    env: dict[str, str] = {}
    for name, value, _where in container_env(objects, deployment):
        if value is not None:
            env[name] = value
    if service == "edge" and "SLUICE_EDGE_API_KEYS_FILE" in env:
        # The file comes from a Secret volume at run time; parse with an empty stand-in.
        stand_in = tmp_path / "keys"
        stand_in.write_text("")
        env["SLUICE_EDGE_API_KEYS_FILE"] = str(stand_in)
    return parse_service(service, env)


def _port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port: a number, or the name of a container port."""
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"port name {port!r} is not a port of container {container['name']}"
    return named[port]


def test_every_object_matches_the_kubernetes_schemas(overlay):
    objects = render(overlay)
    assert objects, f"{overlay} rendered nothing"
    problems = [
        problem
        for version in (OLDEST_K8S, NEWEST_K8S)
        for obj in objects
        if (problem := _schema_errors(obj, version))
    ]
    assert not problems, "\n".join(problems)
    kinds = sorted(o["kind"] for o in objects)
    print(f"{overlay}: {len(objects)} objects valid for Kubernetes {OLDEST_K8S} and {NEWEST_K8S}: {kinds}")


def test_the_schema_check_rejects_broken_objects(overlay):
    """The validator is strict: a misspelt field or a named gRPC probe port fails."""
    worker = copy.deepcopy(deployments(render(overlay))["worker"])
    container_of(worker)["readinessProbe"]["grpc"]["port"] = "grpc"
    assert _schema_errors(worker, NEWEST_K8S)
    service = copy.deepcopy(find(render(overlay), "Service", "sluice-worker"))
    service["spec"]["clusterIp"] = service["spec"].pop("clusterIP")
    assert "clusterIp" in (_schema_errors(service, NEWEST_K8S) or "")


def test_every_variable_is_a_real_setting_with_a_valid_value(overlay, tmp_path):
    objects = render(overlay)
    for service, deployment in deployments(objects).items():
        known = settings_of(service)
        for name, _value, where in container_env(objects, deployment):
            assert name in known, f"{service}: {name} (from {where}) is not a setting of the {service}"
        # Every literal value parses with the real parser (SystemExit names the bad one).
        _effective_settings(objects, service, tmp_path)


def test_worker_requests_one_gpu_and_probes_its_grpc_port(overlay, tmp_path):
    objects = render(overlay)
    worker = deployments(objects)["worker"]
    container = container_of(worker)
    config = _effective_settings(objects, "worker", tmp_path)
    assert container["resources"]["limits"][GPU] == 1
    assert container["resources"].get("requests", {}).get(GPU, 1) == 1
    assert _port_number(container, "grpc") == config.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == config.port, f"worker {probe} port"
    # The startup probe covers a first start that converts the model; liveness and
    # readiness only begin after it.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    annotations = worker["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert (
        int(annotations["prometheus.io/port"])
        == config.resolved_metrics_port
        == _port_number(container, "metrics")
    )


def test_worker_drain_fits_in_the_termination_grace(overlay, tmp_path):
    objects = render(overlay)
    worker = deployments(objects)["worker"]
    config = _effective_settings(objects, "worker", tmp_path)
    grace = worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= config.grace_period + 5, (
        f"worker grace {grace}s < --grace-period {config.grace_period}s + 5"
    )
    liveness = container_of(worker)["livenessProbe"]
    # A drain flips health to NOT_SERVING; even if the kubelet kept probing liveness while the
    # pod terminates, the restart must not come before the termination grace runs out.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= grace
    # One worker out at a time, without needing a spare GPU for a surge pod.
    assert worker["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_edges_discover_workers_through_the_headless_service(overlay, tmp_path):
    objects = render(overlay)
    edge = _effective_settings(objects, "edge", tmp_path)
    worker_config = _effective_settings(objects, "worker", tmp_path)
    assert edge.worker_dns, "the edge should find workers by DNS (SLUICE_EDGE_WORKER_DNS)"
    host, _, port = edge.worker_dns.rpartition(":")
    service = find(objects, "Service", host)
    assert service["spec"]["clusterIP"] == "None", "the worker Service must be headless"
    worker = deployments(objects)["worker"]
    pod_labels = worker["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    assert _port_number(container_of(worker), service_port["targetPort"]) == worker_config.port


def test_edge_probes_ports_and_paths_agree_with_the_edge(overlay, tmp_path):
    from edge.app import create_app

    objects = render(overlay)
    edge = deployments(objects)["edge"]
    container = container_of(edge)
    settings = _effective_settings(objects, "edge", tmp_path)
    assert settings.host == "0.0.0.0", "the edge must listen on the pod's address"
    routes = {rule.rule for rule in create_app(settings).url_map.iter_rules()}
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in routes
        assert _port_number(container, get["port"]) == settings.port
    service = find(objects, "Service", "sluice-edge")
    assert service["spec"]["selector"].items() <= edge["spec"]["template"]["metadata"]["labels"].items()
    assert {_port_number(container, p["targetPort"]) for p in service["spec"]["ports"]} == {settings.port}
    annotations = edge["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == settings.port
    assert annotations["prometheus.io/path"] in routes


def test_edge_drain_fits_in_the_termination_grace(overlay, tmp_path):
    objects = render(overlay)
    edge = deployments(objects)["edge"]
    settings = _effective_settings(objects, "edge", tmp_path)
    grace = edge["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    needed = settings.drain_delay_s + settings.graceful_timeout_s + 5
    assert grace >= needed, f"edge grace {grace}s < drain delay + graceful timeout + 5 = {needed}s"


def test_edge_api_keys_come_from_a_secret_file(overlay):
    objects = render(overlay)
    edge = deployments(objects)["edge"]
    env = {name: value for name, value, _ in container_env(objects, edge)}
    assert "SLUICE_EDGE_API_KEYS" not in env, "keys belong in a Secret, not in the manifests"
    path = env["SLUICE_EDGE_API_KEYS_FILE"]
    assert path
    pod = edge["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in container_of(edge)["volumeMounts"]}
    volume_name = mounts[posixpath.dirname(path)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == volume_name]
    assert volume["secret"]["secretName"] == "sluice-edge-api-keys"


def test_autoscaler_and_disruption_budgets_select_the_right_pods(overlay):
    objects = render(overlay)
    by_service = deployments(objects)
    hpa = find(objects, "HorizontalPodAutoscaler", "sluice-edge")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", by_service["edge"]["metadata"]["name"])
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert "replicas" not in by_service["edge"]["spec"], "the HPA owns the edge replica count"
    assert "cpu" in container_of(by_service["edge"])["resources"]["requests"], (
        "CPU utilisation needs a request"
    )
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for service, deployment in by_service.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        matching = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(matching) == 1, f"{service}: expected one PodDisruptionBudget, found {len(matching)}"


def test_pods_run_as_the_images_non_root_user(overlay):
    from tests.deploy.test_images import dockerfile_user

    for service, deployment in deployments(render(overlay)).items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == int(dockerfile_user(service).split(":")[0])
        context = container_of(deployment)["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
