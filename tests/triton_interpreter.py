"""Runs Triton kernel checks under triton's CPU interpreter in one child process: triton must see
``TRITON_INTERPRET=1`` before it is imported (its library functions are decorated at import), so a
test module's checks run in ``python -m that.module``, which prints one JSON line of results."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

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


def interpreted_results(module: str, timeout: float = 600) -> dict[str, str | None]:
    """Runs ``python -m module`` with the interpreter on; its checks' results."""
    environment = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    completed = subprocess.run(
        [sys.executable, "-m", module],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    results: dict[str, str | None] = json.loads(completed.stdout.strip().splitlines()[-1])
    return results
