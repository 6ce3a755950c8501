"""The tests' zygote's engine-process hook without a zygote: a fork it cannot get falls back to a
spawned engine, and a forked engine's end reads as a ``multiprocessing.Process``'s; which
environments a child may be forked with."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import zygote
from worker.engine import process


def test_an_engine_the_zygote_cannot_fork_is_spawned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spawned: list[tuple[Any, Any]] = []

    def spawn(config: Any, build: Any) -> Any:
        spawned.append((config, build))
        return "process", "connection"

    monkeypatch.setattr(process, "spawned_engine", spawn)
    monkeypatch.setattr(process, "spawn_engine", process.spawn_engine)  # put back after the test
    zygote._fork_engine(str(tmp_path / "no-zygote"), dict(os.environ), str(tmp_path / "log"))
    assert process.spawn_engine("config", print) == ("process", "connection")  # no zygote listening
    zygote._fork_engine(str(tmp_path / "no-zygote"), {"OTHER": "1"}, str(tmp_path / "log"))
    assert process.spawn_engine("config", print) == ("process", "connection")  # another environment
    assert spawned == [("config", print), ("config", print)]


def test_a_forked_engine_ends_as_a_multiprocessing_process_does() -> None:
    ours, zygotes = socket.socketpair()
    engine = zygote.EngineFork(zygote.ForkedProcess(["engine"], ours, 12345))
    assert engine.pid == 12345 and engine.is_alive() and engine.exitcode is None
    engine.join(0.01)  # times out quietly, as Process.join does
    zygotes.sendall(json.dumps({"exit": -signal.SIGKILL}).encode() + b"\n")
    zygotes.close()
    engine.join(30)
    assert not engine.is_alive() and engine.exitcode == -signal.SIGKILL


def test_a_variable_an_import_sets_on_one_side_only_still_forks_but_two_values_do_not() -> None:
    """torch's inductor (imported by peft, and by the zygote's own preload) sets its cache folder
    and scikit-learn its OpenMP settings: a pytest process that imported them after its zygote
    started, or that never did while the zygote did, still forks its workers, their engine
    processes and follower ranks (unignored, a CI run's second half started every process fresh:
    a killed-follower test's call took 22.5 s instead of 1.7 s)."""
    base = {"PATH": "/usr/bin", "SLUICE_WORKER_PORT": "1"}
    for key in ("TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"):
        assert zygote._same_env({**base, key: "/tmp/a"}, base)
        assert zygote._same_env(base, {**base, key: "/tmp/a"})
        assert zygote._same_env({**base, key: "/tmp/a"}, {**base, key: "/tmp/a"})
        assert not zygote._same_env({**base, key: "/tmp/a"}, {**base, key: "/tmp/b"})
    assert zygote._same_env({**base, "SLUICE_WORKER_PORT": "2", "PYTEST_XDIST_WORKER": "gw1"}, base)
    # Read when a child's tracer builds its span processor: the tracing modules' processes fork.
    assert zygote._same_env({**base, "OTEL_BSP_SCHEDULE_DELAY": "50"}, base)
    assert not zygote._same_env({**base, "TRITON_INTERPRET": "1"}, base)
    assert not zygote._same_env(base, {**base, "TRITON_INTERPRET": "1"})


def test_a_start_made_fresh_by_the_test_process_own_drift_is_warned_of_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A variable this pytest process gained after its zygote started (an import's, say) makes
    every later start fresh: ``make test`` says so once instead of paying seconds per start in
    silence; a variable a test passes to its process on purpose is no drift."""
    started = zygote.Zygote.__new__(zygote.Zygote)  # no process: only the environment is compared
    started.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started.process = type("Running", (), {"poll": lambda self: None})()  # type: ignore[assignment]
    monkeypatch.setattr(zygote.Zygote, "_warned", set())
    worker = [sys.executable, "-m", "worker", "--port", "1"]
    where = {"cwd": tmp_path, "log": tmp_path / "log", "append": False}
    on_purpose = {**os.environ, "TRITON_INTERPRET": "1"}
    assert started.start(worker, env=on_purpose, **where) is None  # type: ignore[arg-type]
    monkeypatch.setenv("SLUICE_TEST_DRIFT_CHECK", "child-only")  # no drift: SLUICE_* is the child's
    monkeypatch.setenv("A_VARIABLE_AN_IMPORT_SET", "1")
    with pytest.warns(UserWarning, match=r"changed since its zygote started \(A_VARIABLE_AN_IMPORT_SET\)"):
        assert started.start(worker, env=dict(os.environ), **where) is None  # type: ignore[arg-type]
    started.start(worker, env=dict(os.environ), **where)  # type: ignore[arg-type]  # warned once
    assert zygote.Zygote._warned == {("A_VARIABLE_AN_IMPORT_SET",)}
