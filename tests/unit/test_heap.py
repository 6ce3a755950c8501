"""Freezing the start-up heap (sluice/heap.py)."""

from __future__ import annotations

import atexit
import gc
import logging
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sluice.heap import YOUNG_GENERATION_THRESHOLD, freeze_startup_heap

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def heap_restored() -> Iterator[None]:
    """This test process's heap as it was after the test: unfrozen, the collector's thresholds back."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class Node:
    """An object that can sit in a reference cycle (only the collector frees those)."""

    peer: Node | None = None


def test_a_frozen_cycle_waits_for_the_unfreeze_at_exit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, heap_restored: None
) -> None:
    at_exit: list[Callable[[], None]] = []
    monkeypatch.setattr(atexit, "register", at_exit.append)
    node = Node()
    node.peer = node
    ref = weakref.ref(node)
    with caplog.at_level(logging.INFO):
        frozen = freeze_startup_heap(logging.getLogger("test"), "test process")
    assert frozen > 0
    assert f"test process: {frozen} objects from start-up left out of garbage collection" in caplog.text
    del node
    gc.collect()
    assert ref() is not None  # alive at the freeze: full collections no longer visit it
    assert at_exit == [gc.unfreeze]
    at_exit[0]()
    gc.collect()
    assert ref() is None  # unfrozen (as at exit), the cycle is collected


def test_young_collections_come_less_often_once_the_heap_is_frozen(
    monkeypatch: pytest.MonkeyPatch, heap_restored: None
) -> None:
    monkeypatch.setattr(atexit, "register", lambda hook: None)
    # CPython's young threshold (an in-process edge's start may have raised it), older ones told apart.
    gc.set_threshold(700, 11, 12)
    freeze_startup_heap(logging.getLogger("test"), "test process")
    # The young generation's threshold alone changes; the older generations' stay as they were.
    assert gc.get_threshold() == (YOUNG_GENERATION_THRESHOLD, 11, 12)
    assert YOUNG_GENERATION_THRESHOLD > 700


EXITING = """
import atexit, logging, sys
from sluice.heap import exit_without_collecting, freeze_startup_heap

class Loud:
    def __del__(self):
        print("collected at teardown", flush=True)

loud = Loud()
loud.peer = loud  # a cycle: only a collection frees it
atexit.register(print, "atexit hook ran")
freeze_startup_heap(logging.getLogger("test"), "test process")
del loud
print("buffered, never flushed by hand")
exit_without_collecting(7)
"""


def test_an_exit_without_collecting_runs_the_hooks_and_skips_the_teardown() -> None:
    """The hooks run and the streams are flushed; the frozen cycle is never collected (the
    interpreter's teardown would: ``sys.exit`` prints "collected at teardown")."""
    done = subprocess.run(
        [sys.executable, "-c", EXITING], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert done.returncode == 7, done.stderr
    assert done.stdout.splitlines() == ["buffered, never flushed by hand", "atexit hook ran"]
