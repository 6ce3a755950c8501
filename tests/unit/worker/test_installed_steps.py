"""The step a forward runs in is installed per thread: a forward in another thread (ranks run as
threads, transformers' own ``generate`` beside a running engine) never sees the engine's step, and
two threads' interleaved steps leave none installed behind them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest

from worker.attention import paged
from worker.model import recurrent

INSTALLS: dict[str, tuple[Callable[[Any], AbstractContextManager[None]], Callable[[], object]]] = {
    "paged": (paged.paged_step, lambda: paged.STEP.value),
    "recurrent": (recurrent.state_step, lambda: recurrent.STATES.value),
}


@pytest.mark.parametrize("kind", sorted(INSTALLS))
def test_another_thread_does_not_see_the_step(kind: str) -> None:
    install, installed = INSTALLS[kind]
    step, inside, leave = object(), threading.Event(), threading.Event()
    seen_inside: list[object] = []

    def engine() -> None:
        with install(step):
            seen_inside.append(installed())
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=engine)
    thread.start()
    assert inside.wait(10)
    seen_here = installed()
    leave.set()
    thread.join(10)
    assert seen_inside == [step] and seen_here is None


@pytest.mark.parametrize("kind", sorted(INSTALLS))
def test_interleaved_steps_of_two_threads_leave_none_installed(kind: str) -> None:
    """A enters, B enters, A leaves, B leaves: as one global, B's exit restored A's step for good."""
    install, installed = INSTALLS[kind]
    order = [threading.Event() for _ in range(4)]
    after: dict[str, object] = {}

    def rank(name: str, enter: int, leave: int) -> None:
        if enter:
            order[enter - 1].wait(10)
        with install(object()):
            order[enter].set()
            order[leave - 1].wait(10)
        order[leave].set()
        after[name] = installed()

    threads = [
        threading.Thread(target=rank, args=("a", 0, 2)),
        threading.Thread(target=rank, args=("b", 1, 3)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert after == {"a": None, "b": None} and installed() is None
