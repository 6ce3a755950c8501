"""Starts test workers and edges by forking a process that has already imported them: each is a
real process running ``python -m worker`` / ``python -m edge``'s own main, without the seconds of
importing torch and transformers every time (docs/testing.md, "Processes")."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# What a forked child may differ in from the zygote's environment at import (read only once the
# child's main runs, or pytest's own). Any other difference (say TRITON_INTERPRET) starts a fresh process.
_CHILD_ONLY = ("SLUICE_", "PYTHONUNBUFFERED", "PYTEST_")
MODULES = ("worker", "edge")


def _preload() -> None:
    """Imports what ``python -m worker`` and ``python -m edge`` import before serving."""
    import edge.__main__
    import worker.__main__
    import worker.server  # the heavy part: torch, transformers

    del edge, worker


# ------------------------------------------------------------------ the zygote process


def _serve(path: str) -> None:
    """The zygote's loop, on one thread (forking is safe only from a single-threaded process):
    accepts start requests, forks, reports each child's pid and later its exit status."""
    _preload()
    # No Python thread may run (its locks would be copied held); torch's idle native threads are
    # left behind by a fork, as its DataLoader's forked workers leave them.
    if threading.active_count() != 1:
        print("threads", flush=True)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        _reap(children)
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):  # the test process is gone
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in children:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            return
        if listener in readable:
            connection, _ = listener.accept()
            request = json.loads(connection.makefile("rb").readline())
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                _child(connection, request)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = connection


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                code = os.waitstatus_to_exitcode(status)
                connection.sendall(json.dumps({"exit": code}).encode() + b"\n")
            connection.close()


def _child(connection: socket.socket, request: Mapping[str, Any]) -> None:
    """In the forked child: the test's log as stdout and stderr, its environment and arguments,
    then the module's ``__main__`` as ``python -m`` runs it, and the interpreter's exit steps."""
    connection.close()
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
    log = os.open(request["log"], flags, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    module = request["module"]
    sys.argv = [module, *request["args"]]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # joins threads, as at interpreter exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------ the test process's side


class ForkedProcess:
    """A child of the zygote, with the part of :class:`subprocess.Popen`'s interface the tests use
    (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``)."""

    def __init__(self, args: Sequence[str], connection: socket.socket, pid: int):
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._connection = connection
        self._reader = connection.makefile("rb")

    def _read_exit(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        if not select.select([self._connection], [], [], timeout)[0]:
            return
        line = self._reader.readline()
        self.returncode = int(json.loads(line)["exit"]) if line else -signal.SIGKILL
        self._connection.close()

    def poll(self) -> int | None:
        self._read_exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_exit(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test process's zygote, started on first use; None from :meth:`start` when it cannot
    serve a command (then the caller starts a fresh process)."""

    _instance: Zygote | None = None
    _failed = False

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="sluice-zygote-")
        self.path = str(Path(self.folder) / "socket")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        root = Path(__file__).resolve().parent.parent
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.path],
            cwd=root,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        answer = self.process.stdout.readline().strip()
        if answer != b"ready":
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"the test zygote did not start: {answer!r}")
        atexit.register(self.close)

    def close(self) -> None:
        """Ends the zygote (and any child still running) and waits for it."""
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    @classmethod
    def shared(cls) -> Zygote | None:
        if cls._instance is None and not cls._failed and os.environ.get("SLUICE_TEST_ZYGOTE", "1") != "0":
            try:
                cls._instance = cls()
            except (OSError, RuntimeError) as error:
                print(f"tests/zygote.py: starting processes fresh ({error})", file=sys.stderr)
                cls._failed = True
        return cls._instance

    def serves(self, args: Sequence[str], env: Mapping[str, str]) -> str | None:
        """The module of ``args`` when the zygote can start it with ``env``, else None."""
        if len(args) < 3 or args[0] != sys.executable or args[1] != "-m" or args[2] not in MODULES:
            return None
        keys = set(env) | set(self.env)
        for key in keys:
            if not key.startswith(_CHILD_ONLY) and env.get(key) != self.env.get(key):
                return None
        if self.process.poll() is not None:
            return None
        return args[2]

    def start(
        self, args: Sequence[str], *, env: Mapping[str, str], cwd: Path, log: Path, append: bool
    ) -> ForkedProcess | None:
        """Forks ``args`` (``python -m worker|edge ...``) writing to ``log``; None if it cannot."""
        module = self.serves(args, env)
        if module is None:
            return None
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        request = {
            "module": module,
            "args": list(args[3:]),
            "env": dict(env),
            "cwd": str(cwd),
            "log": str(log),
            "append": append,
        }
        try:
            connection.connect(self.path)
            connection.sendall(json.dumps(request).encode() + b"\n")
            reader = connection.makefile("rb")
            pid = int(json.loads(reader.readline())["pid"])
        except (OSError, ValueError, KeyError):
            connection.close()
            return None
        return ForkedProcess(args, connection, pid)


if __name__ == "__main__":
    _serve(sys.argv[1])
