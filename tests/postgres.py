"""A real PostgreSQL server from Debian's package for the state-store tests: initdb and postgres in a
temporary folder on a free port, as ``nobody`` when the tests run as root (PostgreSQL refuses root)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from tests.processes import free_port

START_TIMEOUT_S = 60.0
INSTALL_HINT = "apt-get install -y postgresql (make postgres-deps does it as root)"


def server_binaries() -> Path | None:
    """The folder holding ``initdb`` and ``postgres``: on PATH, else Debian's
    ``/usr/lib/postgresql/<version>/bin`` (the newest)."""
    initdb = shutil.which("initdb")
    if initdb is not None and shutil.which("postgres") is not None:
        return Path(initdb).resolve().parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """One throwaway server; ``url`` reaches its ``postgres`` database as the ``postgres`` user."""

    def __init__(self, binaries: Path) -> None:
        self.binaries = binaries
        self.folder = Path(tempfile.mkdtemp(prefix="sluice-pg-"))  # in /tmp: reachable by nobody
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.process: subprocess.Popen[bytes] | None = None
        as_root = os.geteuid() == 0
        self._user = {"user": "nobody", "group": "nogroup"} if as_root else {}
        if as_root:
            shutil.chown(self.folder, "nobody", "nogroup")

    def _run(self, *args: str) -> None:
        subprocess.run(
            [str(self.binaries / args[0]), *args[1:]], check=True, capture_output=True, **self._user
        )

    def __enter__(self) -> PostgresServer:
        data = self.folder / "data"
        self._run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        log = open(self.folder / "postgres.log", "wb")
        server = [str(self.binaries / "postgres"), "-D", str(data), "-p", str(self.port)]
        self.process = subprocess.Popen(
            [*server, "-h", "127.0.0.1", "-k", str(self.folder), "-c", "fsync=off"],
            stdout=log,
            stderr=subprocess.STDOUT,
            **self._user,
        )
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import psycopg

        end = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited: {(self.folder / 'postgres.log').read_text()[-2000:]}")
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.1)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGINT)  # fast shutdown: sessions ended, no wait for them
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
