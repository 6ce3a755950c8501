"""The tests' zygote's engine-process hook without a zygote: a fork it cannot get falls back to a
spawned engine, and a forked engine's end reads as a ``multiprocessing.Process``'s."""

from __future__ import annotations

import json
import os
import signal
import socket
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
