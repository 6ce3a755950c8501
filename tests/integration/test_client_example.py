"""docs/examples/client_example.py runs as documented against a real worker."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import REPO_ROOT, WorkerProcess

pytestmark = pytest.mark.integration

EXAMPLE = REPO_ROOT / "docs" / "examples" / "client_example.py"


def test_client_example_runs_against_a_worker(
    tiny_model_dir: Path, model_cache: Path, tmp_path: Path
) -> None:
    with WorkerProcess(cache_dir=model_cache, log_dir=tmp_path, model=str(tiny_model_dir)) as worker:
        # Run from another folder, as a user would: nothing may depend on the repository's cwd.
        done = subprocess.run(
            [sys.executable, str(EXAMPLE), worker.address],
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
        assert any(
            line.startswith("[finished: LENGTH]") or line.startswith("[finished: STOP]") for line in lines
        )
        assert "[stopped after 3 deltas; the call was cancelled]" in lines
        assert "[refused: INVALID_ARGUMENT, reason=invalid_parameter, param=max_tokens]" in lines
        # The early stop reached the worker: it cancelled that request (at its next engine step).
        deadline = time.monotonic() + 10
        while worker.metrics()["sluice_worker_requests_cancelled_total"] < 1:
            assert time.monotonic() < deadline, "the worker never saw the early stop"
            time.sleep(0.05)
