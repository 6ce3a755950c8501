"""The model loads in a thread of its own that is gone once loading ends (see worker.server.in_own_thread)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from worker.model.loader import ModelLoadError
from worker.server import in_own_thread


def test_runs_in_a_new_thread_that_has_ended_when_the_result_arrives():
    async def main() -> tuple[threading.Thread, int]:
        return await in_own_thread(lambda x: (threading.current_thread(), x * 2), 21)

    ran_in, value = asyncio.run(main())
    assert value == 42
    assert ran_in is not threading.main_thread() and ran_in.name == "sluice-loader"
    ran_in.join(timeout=5)
    assert not ran_in.is_alive()
    # Not a thread of asyncio's executor, which would outlive the load with its OpenMP team.
    assert not any(t.name.startswith("asyncio_") for t in threading.enumerate())


def test_an_error_reaches_the_awaiting_task():
    def fail(_: None) -> None:
        raise ModelLoadError("no such model")

    async def main() -> None:
        await in_own_thread(fail, None)

    with pytest.raises(ModelLoadError, match="no such model"):
        asyncio.run(main())


def test_a_caller_that_stops_waiting_leaves_no_error_behind():
    finished = threading.Event()

    def slow(_: None) -> int:
        time.sleep(0.3)
        finished.set()
        return 1

    async def main() -> None:
        task = asyncio.ensure_future(in_own_thread(slow, None))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # the thread finishes and settles a cancelled future: ignored

    asyncio.run(main())
    assert finished.is_set()
