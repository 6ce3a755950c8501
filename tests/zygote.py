"""Starts test workers and edges by forking a process that has already imported them: each is a
real process running ``python -m worker`` / ``python -m edge``'s own main, without the seconds of
importing torch and transformers every time (docs/testing.md, "Processes")."""

from __future__ import annotations

import atexit
import base64
import contextlib
import gc
import json
import os
import pickle
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

# What a forked child may differ in from the zygote's environment at import (read only once the
# child's main runs, or pytest's own; OpenTelemetry's batch span processor reads its OTEL_BSP_*
# settings when the child's tracer builds one). Any other difference (say TRITON_INTERPRET) starts
# a fresh process.
_CHILD_ONLY = ("SLUICE_", "PYTHONUNBUFFERED", "PYTEST_", "OTEL_BSP_")
# What libraries set in os.environ as they are imported or first used (torch's inductor its cache
# folder, in the zygote's preload too; scikit-learn, imported by sentence-transformers, its OpenMP
# settings, read only by Intel's OpenMP runtime, which torch does not use): present on one side only,
# such a variable is no difference; with two values it is. Unignored, one in-process import left
# every later start of that pytest process fresh, and every engine process and follower rank.
_SET_BY_IMPORTS = ("TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")
FOLLOWER = "worker.parallel.follower"
MODULES = ("worker", "edge", FOLLOWER)
ENGINE = "worker.engine.process"  # a forked engine process runs its engine_main (no module main)


def _preload() -> None:
    """Imports what ``python -m worker`` and ``python -m edge`` import before serving."""
    import edge.__main__
    import worker.__main__
    import worker.parallel.follower
    import worker.server  # the heavy part: torch, transformers

    del edge, worker


def end_server(process: subprocess.Popen[Any]) -> None:
    """Ends a fork server that exits when its standard input closes (killed after 30 s)."""
    assert process.stdin is not None
    with contextlib.suppress(OSError):
        process.stdin.close()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


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
    # What the import left alive lives as long as every child: collected once and frozen here, a
    # child's full collections (freeze_startup_heap's too, about 0.5 CPU-s over this heap) never
    # walk it again, and its pages stay shared with the zygote instead of being copied on write.
    gc.collect()
    gc.freeze()
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
            request, descriptors = _read_request(connection)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                _child(connection, request, path, descriptors)
            for descriptor in descriptors:  # the child's now
                os.close(descriptor)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = connection


def _read_request(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One start request: a line of JSON, and the descriptors sent with it (SCM_RIGHTS: an engine
    process's end of its pipe)."""
    data, descriptors = b"", []
    while not data.endswith(b"\n"):
        chunk, received, _, _ = socket.recv_fds(connection, 1 << 16, 4)
        descriptors += received
        if not chunk:
            break
        data += chunk
    return json.loads(data), descriptors


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


def _child(
    connection: socket.socket, request: Mapping[str, Any], path: str, descriptors: Sequence[int]
) -> None:
    """In the forked child: the test's log as stdout and stderr (appended to, so that the
    followers it forks write beside it), its environment and arguments, its standard input if the
    request has one, then the module's ``__main__`` as ``python -m`` runs it (an engine process's
    engine_main on the pipe end in ``descriptors``), and the interpreter's exit steps. A worker it
    runs forks its engine process and tensor-parallel followers from the zygote too."""
    connection.close()
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if request["append"] else os.O_TRUNC)
    log = os.open(request["log"], flags, 0o644)
    os.dup2(_standard_input(request.get("stdin")), 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(request["cwd"])
    zygote_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(request["env"])
    _fork_followers(path, zygote_env, request["log"])
    _fork_engine(path, zygote_env, request["log"])
    module = request["module"]
    sys.argv = [module, *request["args"]]
    if module == ENGINE:
        code = _run(lambda: _engine_main(descriptors[0]))
    else:
        code = _run(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # joins threads, as at interpreter exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _run(main: Callable[[], object]) -> int:
    """Runs ``main`` as an interpreter runs its main module; returns the exit status."""
    code = 0
    try:
        main()
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    return code


def _engine_main(descriptor: int) -> None:
    """An engine process: its settings and build function (pickled) on standard input, its pipe's
    end the socket ``descriptor``, as a spawned one gets them as its target's arguments."""
    from worker.engine.process import engine_main

    config, build = pickle.loads(sys.stdin.buffer.read())
    engine_main(Connection(descriptor), config, build)


def _standard_input(data: str | None) -> int:
    """A descriptor to read as standard input: an unnamed file holding ``data`` (base64), or
    /dev/null without."""
    if data is None:
        return os.open(os.devnull, os.O_RDONLY)
    with tempfile.TemporaryFile() as held:
        held.write(base64.b64decode(data))
        held.flush()
        descriptor = os.dup(held.fileno())
    os.lseek(descriptor, 0, os.SEEK_SET)
    return descriptor


def _fork_followers(path: str, zygote_env: Mapping[str, str], log: str) -> None:
    """Makes a tensor-parallel rank 0 in this child start its followers as children of the zygote
    (``worker.parallel.ranks.spawn_follower``), writing to the same log; a fresh interpreter
    where the environment has changed since or the zygote cannot fork."""
    from worker.parallel import ranks

    def spawn(payload: bytes) -> ranks.RankProcess:
        env = dict(os.environ)
        if _same_env(env, zygote_env):
            request = {
                "module": FOLLOWER,
                "args": [],
                "env": env,
                "cwd": os.getcwd(),
                "log": log,
                "append": True,
                "stdin": base64.b64encode(payload).decode(),
            }
            forked = _request_fork(path, request, [sys.executable, "-m", FOLLOWER])
            if forked is not None:
                return forked
        return ranks.fresh_follower(payload)

    ranks.spawn_follower = spawn


def _fork_engine(path: str, zygote_env: Mapping[str, str], log: str) -> None:
    """Makes an ``--engine-process`` worker in this child start its engine process as a child of
    the zygote (``worker.engine.process.spawn_engine``), its pipe a socket pair whose other end
    travels with the request, writing to the same log; spawned as before where the environment has
    changed since or anything fails."""
    from worker.engine import process

    def spawn(config: Any, build: Any) -> tuple[process.EngineProcess, Connection]:
        if _same_env(os.environ, zygote_env):
            with contextlib.suppress(Exception):
                forked = _forked_engine(path, log, pickle.dumps((config, build)))
                if forked is not None:
                    return forked
        return process.spawned_engine(config, build)

    process.spawn_engine = spawn


def _forked_engine(path: str, log: str, payload: bytes) -> tuple[EngineFork, Connection] | None:
    """Asks the zygote to fork an engine process reading ``payload``; it and our pipe's end, or
    None if it cannot."""
    ours, theirs = socket.socketpair()
    request = {
        "module": ENGINE,
        "args": [],
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "log": log,
        "append": True,
        "stdin": base64.b64encode(payload).decode(),
    }
    with theirs:
        forked = _request_fork(path, request, [sys.executable, "-m", ENGINE], [theirs.fileno()])
    if forked is None:
        ours.close()
        return None
    return EngineFork(forked), Connection(ours.detach())


def _same_env(env: Mapping[str, str], zygote_env: Mapping[str, str]) -> bool:
    """Whether a child with ``env`` may be forked from a zygote imported with ``zygote_env``."""
    return not _differences(env, zygote_env)


def _differences(env: Mapping[str, str], zygote_env: Mapping[str, str]) -> list[str]:
    """The variables that keep a child with ``env`` from being forked from a zygote imported with
    ``zygote_env``."""
    return sorted(
        key
        for key in set(env) | set(zygote_env)
        if not key.startswith(_CHILD_ONLY)
        and env.get(key) != zygote_env.get(key)
        and not (key in _SET_BY_IMPORTS and (key not in env or key not in zygote_env))
    )


def _request_fork(
    path: str, request: Mapping[str, Any], args: Sequence[str], descriptors: Sequence[int] = ()
) -> ForkedProcess | None:
    """Asks the zygote listening on ``path`` to fork ``request``, handing it ``descriptors`` with
    the request's first byte; None if it cannot."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    line = json.dumps(request).encode() + b"\n"
    try:
        connection.connect(path)
        if descriptors:
            socket.send_fds(connection, [line[:1]], list(descriptors))
            line = line[1:]
        connection.sendall(line)
        reader = connection.makefile("rb")
        pid = int(json.loads(reader.readline())["pid"])
    except (OSError, ValueError, KeyError):
        connection.close()
        return None
    return ForkedProcess(args, connection, pid)


# ------------------------------------------------------------------ the test process's side


class ForkedProcess:
    """A child of the zygote, with the part of :class:`subprocess.Popen`'s interface the tests (and
    a rank 0 watching its followers) use (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``,
    ``returncode``); its exit status read by a thread of its own, so any thread may wait."""

    def __init__(self, args: Sequence[str], connection: socket.socket, pid: int):
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()
        threading.Thread(
            target=self._read_exit, args=(connection,), name=f"zygote-child-{pid}", daemon=True
        ).start()

    def _read_exit(self, connection: socket.socket) -> None:
        line = b""
        with contextlib.suppress(OSError), connection, connection.makefile("rb") as reader:
            line = reader.readline()
        self.returncode = int(json.loads(line)["exit"]) if line else -signal.SIGKILL
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout) or self.returncode is None:
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


class EngineFork:
    """A forked engine process, with :class:`multiprocessing.Process`'s interface as
    ``worker.engine.process.EngineProcess`` uses it (``pid``, ``exitcode``, ``is_alive``, ``join``,
    ``terminate``); a signal's death reads as its negative number, as there."""

    def __init__(self, forked: ForkedProcess):
        self._forked = forked

    @property
    def pid(self) -> int:
        return self._forked.pid

    @property
    def exitcode(self) -> int | None:
        return self._forked.poll()

    def is_alive(self) -> bool:
        return self._forked.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._forked.wait(timeout)

    def terminate(self) -> None:
        self._forked.terminate()


class Zygote:
    """The test process's zygote, started on first use; None from :meth:`start` when it cannot
    serve a command (then the caller starts a fresh process)."""

    _instance: Zygote | None = None
    _failed = False
    _warned: ClassVar[set[tuple[str, ...]]] = set()  # the drifts warned of, once each

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
        """Ends the zygote (and any child still running), waits for it and removes its folder."""
        end_server(self.process)
        shutil.rmtree(self.folder, ignore_errors=True)

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
        if not _same_env(env, self.env) or self.process.poll() is not None:
            return None
        return args[2]

    def start(
        self, args: Sequence[str], *, env: Mapping[str, str], cwd: Path, log: Path, append: bool
    ) -> ForkedProcess | None:
        """Forks ``args`` (``python -m worker|edge ...``) writing to ``log``; None if it cannot."""
        module = self.serves(args, env)
        if module is None:
            self._warn_of_drift(args)
            return None
        request = {
            "module": module,
            "args": list(args[3:]),
            "env": dict(env),
            "cwd": str(cwd),
            "log": str(log),
            "append": append,
        }
        return _request_fork(self.path, request, args)

    def _warn_of_drift(self, args: Sequence[str]) -> None:
        """Warns (once per set of variables) when this pytest process's own environment has changed
        since the zygote started, so that its workers and edges start fresh, seconds of CPU each,
        for the rest of the run: in ``make test``'s summary, not silently (a test that passes a
        process other variables on purpose is not warned of)."""
        drift = tuple(_differences(os.environ, self.env))
        if not drift or len(args) < 3 or args[2] not in MODULES or drift in self._warned:
            return
        self._warned.add(drift)
        warnings.warn(
            f"tests/zygote.py: this pytest process's environment changed since its zygote started "
            f"({', '.join(drift)}): its workers and edges now start fresh, seconds of CPU each "
            "(docs/testing.md, 'Processes forked from a zygote')",
            stacklevel=3,
        )


if __name__ == "__main__":
    _serve(sys.argv[1])
