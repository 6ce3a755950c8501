"""The configuration contract: docs/configuration.md is what the parsers say, and every
setting is a flag and an environment variable that rejects a bad value by name.
"""

from __future__ import annotations

import pytest

from tests.deploy.manifests import REPO, SERVICES, parse_service, settings_of
from tools import config_docs

PREFIX = {"worker": "SLUICE_WORKER_", "edge": "SLUICE_EDGE_"}
# A valid configuration to test one bad value against (the edge needs its workers).
BASE_ENV = {"worker": {}, "edge": {"SLUICE_EDGE_WORKERS": "127.0.0.1:50051"}}
# A value each setting must refuse. Settings not listed here are numbers ("not-a-number").
BAD_VALUES = {
    "worker": {
        "--device": "tpu",
        "--dtype": "int3",
        "--log-level": "LOUD",
        "--log-format": "xml",
        "--fake-tokens": "maybe",
        "--metrics-port": "70000",
        "--otlp-traces-endpoint": "collector:4318",
    },
    "edge": {
        "--workers": "no-port-here",
        "--worker-dns": "no-port-here",
        "--host": "",
        "--log-level": "LOUD",
        "--log-format": "xml",
        "--api-keys": "has space",
        "--api-keys-file": "/nonexistent/sluice-keys",
        "--state-url": "mysql://db/state",
        "--otlp-traces-endpoint": "collector:4318",
    },
}
# Free text: any string is a valid value. --model is checked when the model loads (the
# error names the model); the worker's --host when it binds (the error names the address);
# the edge's --state-dir when its store opens.
FREE_TEXT = {
    "worker": {
        "--model",
        "--draft-model",
        "--served-model-name",
        "--host",
        "--cache-dir",
        "--worker-id",
        "--blocked-phrases",
        "--refusal-message",
    },
    "edge": {"--state-dir"},  # a folder, made (or refused, naming it) when the store opens
}


def test_configuration_doc_is_generated_from_the_parsers():
    current = config_docs.DOC_PATH.read_text(encoding="utf-8")
    assert current == config_docs.render(), (
        "docs/configuration.md is stale: run `python -m tools.config_docs` and commit the result"
    )


def test_check_mode_reports_a_stale_doc(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    assert config_docs.main(["--check", "--output", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
    assert config_docs.main(["--output", str(stale)]) == 0
    assert config_docs.main(["--check", "--output", str(stale)]) == 0


def test_every_setting_is_in_the_doc_once():
    text = config_docs.DOC_PATH.read_text(encoding="utf-8")
    for service in SERVICES:
        for env, (flag, _default, _help) in settings_of(service).items():
            row = f"| {service} | `{flag}` | `{env}` |"
            assert text.count(row) == 1, f"{row} should appear once"


def test_running_doc_points_to_the_table():
    assert "configuration.md" in (REPO / "docs" / "running.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("service", SERVICES)
def test_every_setting_is_a_documented_flag_and_variable(service):
    for env, (flag, _default, help_text) in settings_of(service).items():
        assert flag.startswith("--")
        assert env == PREFIX[service] + flag[2:].upper().replace("-", "_")
        assert help_text.strip(), f"{flag} has no help text (it is the doc's meaning column)"


def _bad_cases() -> list[tuple[str, str, str, str, object]]:
    cases = []
    for service in SERVICES:
        for env, (flag, default, _help) in settings_of(service).items():
            if flag in FREE_TEXT[service]:
                continue
            bad = BAD_VALUES[service].get(flag, "not-a-number")
            cases.append((service, flag, env, bad, default))
    return cases


@pytest.mark.parametrize(
    ("service", "flag", "env", "bad", "default"), _bad_cases(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_bad_value_stops_the_service_naming_the_setting(service, flag, env, bad, default, capsys):
    base_env = {} if flag == "--workers" else dict(BASE_ENV[service])
    # From the environment: the message names the variable.
    if bad != "":  # an empty variable means "not set", by design
        with pytest.raises(SystemExit) as stopped:
            parse_service(service, {**base_env, env: bad})
        assert stopped.value.code == 2
        message = capsys.readouterr().err
        assert env in message or flag in message, f"{env}={bad!r}: {message}"
    # From the command line: the message names the flag.
    if not isinstance(default, bool):  # an on/off flag takes no value on the command line
        with pytest.raises(SystemExit) as stopped:
            parse_service(service, base_env, [f"{flag}={bad}"])
        assert stopped.value.code == 2
        message = capsys.readouterr().err
        assert flag in message, f"{flag}={bad!r}: {message}"
        if flag == "--api-keys":
            assert bad not in message, "an API key must never be echoed"


def test_free_text_settings_are_still_settings():
    # Guards the exemption list above against settings that were renamed or removed.
    for service in SERVICES:
        flags = {flag for flag, _d, _h in settings_of(service).values()}
        assert FREE_TEXT[service] <= flags, FREE_TEXT[service] - flags
        assert set(BAD_VALUES[service]) <= flags, set(BAD_VALUES[service]) - flags
