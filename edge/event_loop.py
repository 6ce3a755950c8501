"""Which event loop an edge process runs on: uvloop where it is installed, else asyncio's own.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

#: The values of ``--event-loop``.
EVENT_LOOPS = ("auto", "uvloop", "asyncio")

T = TypeVar("T")


def uvloop_available() -> bool:
    """Whether uvloop can be imported here."""
    return importlib.util.find_spec("uvloop") is not None


def resolve(choice: str) -> str:
    """The loop a ``--event-loop`` value means here: ``uvloop`` or ``asyncio``."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if choice == "auto":
        return "uvloop" if uvloop_available() else "asyncio"
    return choice


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory :class:`asyncio.Runner` takes for ``choice`` (None: asyncio's default loop)."""
    if resolve(choice) == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def running_kind() -> str:
    """``uvloop`` or ``asyncio``: the kind of the loop running now (for the start-up log)."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """Runs ``main`` to completion on a new loop of kind ``choice``, like :func:`asyncio.run`."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
