"""Which event loop an edge process runs on: uvloop where it is installed, else asyncio's own.

uvloop (libuv under asyncio's interface) makes the per-chunk work of a
stream cheaper: the socket write of each SSE chunk, the transport and
protocol callbacks hypercorn's send path goes through, and the loop's own
scheduling of the tasks that read gRPC and write frames (figures in
docs/benchmarks.md, "The edge on uvloop"). grpc.aio runs on any asyncio
loop (its completion queue is polled from the loop through a file
descriptor), so the worker calls need nothing of their own.

``--event-loop``: ``auto`` (the default) picks uvloop when it can be
imported, ``uvloop`` insists on it (a setting error when it is missing),
``asyncio`` keeps the standard library's loop.
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
