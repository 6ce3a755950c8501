"""Freezing the start-up heap (sluice/heap.py)."""

from __future__ import annotations

import atexit
import gc
import logging
import weakref
from collections.abc import Callable

import pytest

from sluice.heap import freeze_startup_heap


class Node:
    """An object that can sit in a reference cycle (only the collector frees those)."""

    peer: Node | None = None


def test_a_frozen_cycle_waits_for_the_unfreeze_at_exit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    at_exit: list[Callable[[], None]] = []
    monkeypatch.setattr(atexit, "register", at_exit.append)
    node = Node()
    node.peer = node
    ref = weakref.ref(node)
    try:
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
    finally:
        gc.unfreeze()
