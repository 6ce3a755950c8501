"""Settings from flags and SLUICE_EDGE_* env vars."""

from __future__ import annotations

import pytest

from edge.settings import Settings


def test_defaults_and_flags() -> None:
    settings = Settings.from_args(["--workers", "127.0.0.1:50051, w2:50052", "--port", "9000"], env={})
    assert settings.workers == ("127.0.0.1:50051", "w2:50052")
    assert (settings.host, settings.port) == ("127.0.0.1", 9000)
    assert settings.heartbeat_interval_s == 15.0
    assert settings.request_timeout_s == 600.0
    assert settings.max_body_bytes == 4 * 1024 * 1024
    assert settings.base_url == "http://127.0.0.1:9000"


def test_env_vars_and_flag_precedence() -> None:
    env = {
        "SLUICE_EDGE_WORKERS": "[::1]:7000",
        "SLUICE_EDGE_PORT": "1234",
        "SLUICE_EDGE_HEARTBEAT_INTERVAL": "0.5",
        "SLUICE_EDGE_REQUEST_TIMEOUT": "30",
    }
    settings = Settings.from_args(["--port", "4321"], env=env)
    assert settings.workers == ("[::1]:7000",)
    assert settings.port == 4321
    assert settings.heartbeat_interval_s == 0.5
    assert settings.request_timeout_s == 30.0


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        ([], {}, "--workers"),
        (["--workers", "nohost"], {}, "--workers"),
        (["--workers", "h:99999"], {}, "--workers"),
        (["--workers", "h:1", "--port", "x"], {}, "--port"),
        (["--workers", "h:1"], {"SLUICE_EDGE_PORT": "x"}, "SLUICE_EDGE_PORT"),
        (["--workers", "h:1", "--heartbeat-interval", "0"], {}, "--heartbeat-interval"),
        (["--workers", "h:1", "--max-body-bytes", "0"], {}, "--max-body-bytes"),
        (["--workers", "h:1", "--event-loop", "trio"], {}, "--event-loop"),
        (["--workers", "h:1"], {"SLUICE_EDGE_EVENT_LOOP": "libev"}, "SLUICE_EDGE_EVENT_LOOP"),
        (["--workers", "h:1", "--migrate-streams", "maybe"], {}, "--migrate-streams: must be on/off"),
        (["--workers", "h:1", "--api-keys-file", "/nonexistent/keys"], {}, "--api-keys-file: cannot read"),
    ],
)
def test_bad_values_exit_with_a_message_naming_the_setting(
    argv: list[str], env: dict[str, str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        Settings.from_args(argv, env=env)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert names in err.splitlines()[-1] and "Traceback" not in err  # the error line, not the usage


def test_settings_are_frozen() -> None:
    settings = Settings(workers=("a:1",))
    with pytest.raises(AttributeError):
        settings.port = 1  # type: ignore[misc]


def test_processes_setting() -> None:
    assert Settings.from_args(["--workers", "w:1"]).process_count == 1
    assert Settings.from_args(["--workers", "w:1", "--processes", "3"]).process_count == 3
    assert Settings.from_args(["--workers", "w:1"], env={"SLUICE_EDGE_PROCESSES": "0"}).process_count >= 1
    with pytest.raises(ValueError, match="processes"):
        Settings(workers=("w:1",), processes=-1)
    with pytest.raises(ValueError, match="fixed port"):
        Settings(workers=("w:1",), processes=2, port=0)


def test_event_loop_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.from_args(["--workers", "w:1"], env={}).event_loop == "auto"
    assert Settings.from_args(["--workers", "w:1", "--event-loop", "asyncio"], env={}).event_loop == "asyncio"
    env = {"SLUICE_EDGE_EVENT_LOOP": "uvloop"}
    assert Settings.from_args(["--workers", "w:1"], env=env).event_loop == "uvloop"
    # Asking for uvloop where it is not installed is a setting error, not a crash at start.
    monkeypatch.setattr("edge.settings.uvloop_available", lambda: False)
    with pytest.raises(ValueError, match="event_loop: uvloop is not installed"):
        Settings(workers=("w:1",), event_loop="uvloop")
    assert Settings(workers=("w:1",), event_loop="auto").event_loop == "auto"


@pytest.mark.parametrize(
    ("argv", "env", "migrate"),
    [
        ([], {}, True),
        (["--no-migrate-streams"], {}, False),
        (["--migrate-streams", "false"], {}, False),
        (["--migrate-streams"], {"SLUICE_EDGE_MIGRATE_STREAMS": "off"}, True),
        ([], {"SLUICE_EDGE_MIGRATE_STREAMS": "0"}, False),
    ],
)
def test_switches_take_the_forms_people_type(argv: list[str], env: dict[str, str], migrate: bool) -> None:
    assert Settings.from_args(["--workers", "h:1", *argv], env=env).migrate_streams is migrate


def test_keys_from_the_file_join_the_flag_and_are_never_shown(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-file-one\n\nsk-both\n")
    settings = Settings.from_args(
        ["--workers", "h:1", "--api-keys", "sk-flag,sk-both", "--api-keys-file", str(keys)]
    )
    assert settings.api_keys == ("sk-flag", "sk-both", "sk-file-one")
    assert "sk-" not in repr(settings)
