"""docs/examples/client_example.py runs as documented against a real worker (the session's
``default_worker``: the example names no model and reads what the worker serves)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import REPO_ROOT, WorkerProcess

pytestmark = pytest.mark.integration

EXAMPLE = REPO_ROOT / "docs" / "examples" / "client_example.py"


def test_client_example_runs_against_a_worker(default_worker: WorkerProcess, tmp_path: Path) -> None:
    cancelled_before = default_worker.metrics()["sluice_worker_requests_cancelled_total"]
    # Run from another folder, as a user would: nothing may depend on the repository's cwd.
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), default_worker.address],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(done.stdout)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("worker ") and " serves " in lines[0]
    assert any(line.startswith("[started: ") for line in lines)
    assert any(line.startswith("[finished: LENGTH]") or line.startswith("[finished: STOP]") for line in lines)
    assert "[stopped after 3 deltas; the call was cancelled]" in lines
    assert "[refused: INVALID_ARGUMENT, reason=invalid_parameter, param=max_tokens]" in lines
    # The early stop reached the worker: it cancelled that request (at its next engine step).
    deadline = time.monotonic() + 10
    while default_worker.metrics()["sluice_worker_requests_cancelled_total"] < cancelled_before + 1:
        assert time.monotonic() < deadline, "the worker never saw the early stop"
        time.sleep(0.05)
