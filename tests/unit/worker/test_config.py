"""The worker's settings table: one declaration per setting, and what is derived from it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.settings import TESTING_GROUP, settings_of
from worker.config import (
    DEFAULT_CACHE_DIR,
    ENV_PREFIX,
    METRICS_PORT_OFFSET,
    WorkerConfig,
    build_parser,
    describe_settings,
    parse_config,
)

REPO = Path(__file__).resolve().parents[3]


def test_every_field_is_a_flag_and_a_variable_with_its_default():
    described = {flag: (env, default) for flag, env, default, _help in describe_settings()}
    defaults = WorkerConfig()
    computed = {s.name for s in settings_of(WorkerConfig, ENV_PREFIX) if s.spec.shown_default is not None}
    for field in dataclasses.fields(WorkerConfig):
        flag = "--" + field.name.replace("_", "-")
        assert flag in described, f"{field.name} is not a setting"
        env, shown = described[flag]
        assert env == ENV_PREFIX + field.name.upper()
        if field.name not in computed:  # a computed default is described in words
            assert shown == getattr(defaults, field.name) == field.default
    assert [f for f, *_ in describe_settings()] == [
        "--" + f.name.replace("_", "-") for f in dataclasses.fields(WorkerConfig)
    ]


def test_the_test_doubles_are_listed_apart_from_the_production_settings():
    doubles = ["--fake-tokens", "--fake-step-ms", "--fake-vocab", "--fake-load-seconds"]
    assert [flag for flag, *_ in describe_settings(testing=True)] == doubles
    production = [flag for flag, *_ in describe_settings(testing=False)]
    assert not set(doubles) & set(production)
    assert not [flag for flag in production if flag.startswith("--fake")]
    _main, _, group = build_parser().format_help().partition(TESTING_GROUP + ":")
    assert all(flag in group for flag in doubles)
    assert parse_config(["--fake-tokens", "--fake-step-ms", "5"], environ={}).fake_step_ms == 5.0


def test_the_removed_cpu_linear_switch_is_refused(capsys):
    """oneDNN-packed weights won (docs/benchmarks.md); ``--cpu-linear torch`` is gone."""
    with pytest.raises(SystemExit):
        parse_config(["--cpu-linear", "torch"], environ={})
    assert "unrecognized arguments: --cpu-linear" in capsys.readouterr().err


def test_no_flags_and_no_environment_give_the_dataclass_defaults():
    assert parse_config([], environ={}) == WorkerConfig()


def test_help_lists_every_setting():
    text = build_parser().format_help()
    for flag, _env, _default, _help in describe_settings():
        assert flag in text


@pytest.mark.parametrize(
    ("argv", "environ", "field", "value"),
    [
        (["--max-running", "4"], {}, "max_running", 4),
        ([], {"SLUICE_WORKER_MAX_RUNNING": "4"}, "max_running", 4),
        (["--max-running", "5"], {"SLUICE_WORKER_MAX_RUNNING": "4"}, "max_running", 5),  # flag wins
        ([], {"SLUICE_WORKER_MAX_RUNNING": ""}, "max_running", None),  # empty = unset: from the device
        ([], {"SLUICE_WORKER_CACHE_DIR": "/tmp/x"}, "cache_dir", Path("/tmp/x")),
        (["--blocked-phrases", "a, b,,c"], {}, "blocked_phrases", ("a", "b", "c")),
        (["--fake-tokens"], {}, "fake_tokens", True),
        (["--batch-invariant"], {}, "batch_invariant", True),
        (["--batch-invariant", "on"], {}, "batch_invariant", True),
        (["--no-prefix-caching"], {}, "prefix_caching", False),
        (["--prefix-caching", "off"], {}, "prefix_caching", False),
        (["--no-prefix-caching"], {"SLUICE_WORKER_PREFIX_CACHING": "on"}, "prefix_caching", False),
        ([], {"SLUICE_WORKER_BATCH_INVARIANT": "true"}, "batch_invariant", True),
        ([], {"SLUICE_WORKER_CUDA_GRAPHS": "0"}, "cuda_graphs", False),
        ([], {"SLUICE_WORKER_FAKE_TOKENS": "on"}, "fake_tokens", True),
        ([], {"SLUICE_WORKER_MAX_BATCH_TOKENS": "100"}, "max_batch_tokens", 100),
        (["--device", "cuda:1"], {}, "device", "cuda:1"),
        (["--model", ""], {}, "model", None),
        (["--kv-offload-bytes", "1024", "--engine-process"], {}, "kv_offload_bytes", 1024),
    ],
)
def test_values_from_flags_and_variables(argv, environ, field, value):
    assert getattr(parse_config(argv, environ=environ), field) == value


def test_metrics_port_defaults_to_the_grpc_port_plus_1000():
    assert WorkerConfig().resolved_metrics_port == 50051 + METRICS_PORT_OFFSET == 51051
    assert parse_config(["--port", "50052"], environ={}).resolved_metrics_port == 51052
    assert parse_config([], environ={"SLUICE_WORKER_PORT": "7000"}).resolved_metrics_port == 8000
    explicit = parse_config(["--port", "50052", "--metrics-port", "9090"], environ={})
    assert explicit.resolved_metrics_port == 9090
    assert parse_config(["--metrics-port", "0"], environ={}).resolved_metrics_port == 0  # off


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "65000"], "--metrics-port: the default (--port + 1000) is 66000, above 65535"),
        (["--port", "7000", "--metrics-port", "7000"], "--metrics-port 7000 is the gRPC --port"),
        (["--port", "0"], "--port: must be at least 1"),
        (["--metrics-port", "-1"], "--metrics-port: must be 0 (off) to 65535"),
        (["--max-running", "x"], "--max-running: must be an integer, got 'x'"),
        (["--grace-period", "inf"], "--grace-period: must be a finite number of seconds"),
        (["--kv-offload-bytes", "1024", "--fake-tokens"], "--kv-offload-bytes needs a generating model"),
        (["--api-server-count", "0"], "--api-server-count: must be"),
    ],
)
def test_bad_values_and_combinations_name_the_setting(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_config(argv, environ={})
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_variable_is_named(capsys):
    with pytest.raises(SystemExit):
        parse_config([], environ={"SLUICE_WORKER_MAX_QUEUE": "0"})
    assert "SLUICE_WORKER_MAX_QUEUE: must be at least 1, got 0" in capsys.readouterr().err


def test_the_cache_dir_default_is_written_once():
    assert WorkerConfig().cache_dir == DEFAULT_CACHE_DIR
    found = subprocess.run(
        [
            "git",
            "grep",
            "-n",
            "-F",
            '".cache"',
            "--",
            "*.py",
            f":(exclude){Path(__file__).relative_to(REPO)}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.splitlines()
    assert [line.split(":")[0] for line in found] == ["worker/config.py"], found


def test_parsing_imports_nothing_heavy():
    # docs generation and the deploy checks read the table; torch must not load for it.
    code = "import sys, worker.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False).returncode == 0
