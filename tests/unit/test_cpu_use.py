"""The benchmarks' CPU accounting of a worker's processes (bench/cpu_use.py)."""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1].parent / "bench"))

from cpu_use import cpu_line, snapshot

BURN_S = 0.3


def burn(go: Any, done: Any, leave: Any) -> None:
    """A child process: uses BURN_S of CPU once told to, then waits to be let go."""
    go.wait(60)
    start = time.process_time()
    while time.process_time() - start < BURN_S:
        pass
    done.set()
    leave.wait(60)


def test_a_spawned_child_counts_as_the_engine_and_its_cpu_is_measured() -> None:
    context = multiprocessing.get_context("spawn")
    go, done, leave = context.Event(), context.Event(), context.Event()
    child = context.Process(target=burn, args=(go, done, leave), daemon=True)
    child.start()
    try:
        time.sleep(0.5)  # most of its start-up CPU before the first snapshot (more would only add)
        before = snapshot(multiprocessing.current_process().pid or 0)
        go.set()
        assert done.wait(60)
        after = snapshot(multiprocessing.current_process().pid or 0)
    finally:
        leave.set()
        child.join(10)
    assert "engine" in before.roles and "engine" in after.roles
    engine_cpu = after.roles["engine"][0] - before.roles["engine"][0]
    assert engine_cpu >= BURN_S - 0.05
    line = cpu_line(before, after, tokens=1000)
    assert line.startswith("cpu per 1000 tokens: serving ")
    engine_part = line.split("; ")[1]
    assert engine_part.startswith("engine ") and int(engine_part.rsplit(" ", 2)[1]) >= 250  # ms per 1000
    assert line.split("; ")[-1].startswith("client ")
