"""Runs Triton kernel checks under triton's CPU interpreter in one child process: triton must see
``TRITON_INTERPRET=1`` before it is imported (its library functions are decorated at import), so a
test module's checks run as ``python -m that.module``, which prints one JSON line of results. Each
child is forked from one server per test process that imported torch, triton and transformers with
the interpreter on (about 10 CPU-s a module saved; ``SLUICE_TEST_ZYGOTE=0`` starts each fresh)."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

from tests.zygote import end_server

REPO_ROOT = Path(__file__).resolve().parents[1]


def ptxas_available() -> bool:
    """Whether triton's CUDA backend can compile here (its ptxas), so kernels can be built for a GPU
    without one."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists() or (
        shutil.which("ptxas") is not None
    )


def run_checks(checks: Mapping[str, Callable[[], None]]) -> dict[str, str | None]:
    """In the child: each check's name -> None, or the traceback of its failure."""
    results: dict[str, str | None] = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results


def print_results(checks: Mapping[str, Callable[[], None]]) -> None:
    """The child's ``__main__``: runs the checks and prints their results as the last line."""
    print(json.dumps(run_checks(checks)))


def _environment() -> dict[str, str]:
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}


def _same(env: dict[str, str], other: dict[str, str]) -> bool:
    """Equal but for pytest's own variables (the current test's name)."""
    return {k: v for k, v in env.items() if not k.startswith("PYTEST_")} == {
        k: v for k, v in other.items() if not k.startswith("PYTEST_")
    }


def interpreted_results(module: str, timeout: float = 600) -> dict[str, str | None]:
    """Runs ``python -m module`` with the interpreter on (forked from the server where it can);
    its checks' results."""
    environment = _environment()
    server = _Server.shared(environment)
    if server is not None:
        code, stdout, stderr = server.run(module, timeout)
    else:
        completed = subprocess.run(
            [sys.executable, "-m", module],
            cwd=REPO_ROOT,
            env=environment,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        code, stdout, stderr = completed.returncode, completed.stdout, completed.stderr
    assert code == 0, stderr[-4000:]
    results: dict[str, str | None] = json.loads(stdout.strip().splitlines()[-1])
    return results


class _Server:
    """The test process's interpreter server (``python -m tests.triton_interpreter``), started on
    first use; None from :meth:`shared` where it cannot serve (then each module starts fresh)."""

    _instance: _Server | None = None
    _failed = False

    def __init__(self, environment: dict[str, str]) -> None:
        self.env = environment
        self.folder = tempfile.mkdtemp(prefix="sluice-interpreter-")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.triton_interpreter"],
            cwd=REPO_ROOT,
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            self.process.kill()
            self.process.wait()
            raise RuntimeError("the interpreter server did not start")
        atexit.register(self.close)

    @classmethod
    def shared(cls, environment: dict[str, str]) -> _Server | None:
        if cls._instance is None and not cls._failed and os.environ.get("SLUICE_TEST_ZYGOTE", "1") != "0":
            try:
                cls._instance = cls(environment)
            except (OSError, RuntimeError) as error:
                print(f"tests/triton_interpreter.py: starting children fresh ({error})", file=sys.stderr)
                cls._failed = True
        server = cls._instance
        if server is None or server.process.poll() is not None or not _same(environment, server.env):
            return None
        return server

    def run(self, module: str, timeout: float) -> tuple[int, str, str]:
        """Forks a child running ``module`` as ``__main__``: its exit code, stdout and stderr."""
        assert self.process.stdin is not None and self.process.stdout is not None
        out, err = (str(Path(self.folder) / f"{module}.{kind}") for kind in ("out", "err"))
        self.process.stdin.write(json.dumps({"module": module, "out": out, "err": err}) + "\n")
        self.process.stdin.flush()
        pid = json.loads(self.process.stdout.readline())["pid"]
        timer = threading.Timer(timeout, _kill, (pid,))  # as subprocess.run's timeout
        timer.start()
        try:
            code = json.loads(self.process.stdout.readline())["exit"]
        finally:
            timer.cancel()
        return code, Path(out).read_text(), Path(err).read_text()

    def close(self) -> None:
        """Ends the server (it exits when its standard input closes) and removes its files."""
        end_server(self.process)
        shutil.rmtree(self.folder, ignore_errors=True)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _serve() -> None:
    """The server's loop (one thread: forking is safe only from a single-threaded process): each
    request line forks a child that runs a test module's ``__main__`` into two files; the server
    answers the child's pid, then its exit code."""
    import torch  # what every module's checks import, with the interpreter on
    import transformers
    import triton

    import worker.attention.triton_decode
    import worker.model.fused
    import worker.model.runner

    del torch, transformers, triton, worker

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(request: dict[str, str]) -> None:
    """In the forked child: stdout and stderr to the request's files, then the module as
    ``python -m`` runs it."""
    for fd, path in ((1, request["out"]), (2, request["err"])):
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(descriptor, fd)
        os.close(descriptor)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = [request["module"]]
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
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
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _serve()
