"""No stream of the engine process's client is left without an end: every way its pipe can end (the
pipe closing, a failed ``recv()``, a message that cannot be decoded, the engine process dying, its
device failing, the client stopping it) ends every open stream with a failure, refuses the requests
that come later, and, unless the client was stopped, reports the device failure (the worker goes
NOT_SERVING and exits non-zero). The engine process is played by a thread (or, where it dies, a
forked process) on the far end of a real pipe; faults that have no natural trigger are injected."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import pytest

from worker.engine.prepare import Prepared
from worker.engine.process import EngineClient
from worker.engine.process_messages import Acked, EngineFailed, ModelFacts, StatsReport, Stop, Submit
from worker.engine.stats import EngineCounters, EngineStats
from worker.errors import GenerationFailed
from worker.model.fake_runner import load_fake_model
from worker.output.processor import TextRules
from worker.types import Failed, GenerationRequest, SamplingOptions

STREAMS = 3
STATS = EngineStats(0, 0, 0, 0, 0, 0, 0, EngineCounters())
# How long a test waits for every stream to end before it calls them hung.
HUNG_S = 30.0


@pytest.fixture(scope="module")
def fake(tiny_model_dir):  # type: ignore[no-untyped-def]
    return load_fake_model(str(tiny_model_dir))


def play_engine(connection: Connection) -> None:
    """The engine process's side of the pipe: acknowledges every request, ends at Stop or EOF."""
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if isinstance(message, Submit):
            connection.send(Acked(message.key))
        elif isinstance(message, Stop):
            connection.close()
            return


class FailingConnection:
    """The client's pipe end, whose ``recv()`` raises (neither EOF nor OSError) once told to."""

    def __init__(self, inner: Connection):
        self._inner = inner
        self.fail = threading.Event()

    def recv(self) -> Any:
        message = self._inner.recv()
        if self.fail.is_set():
            raise RuntimeError("injected: recv() failed")
        return message

    def send(self, message: Any) -> None:
        self._inner.send(message)


class Harness:
    """An :class:`EngineClient` on one end of a pipe, the engine process played on the other."""

    def __init__(self, fake: Any, *, real_child: bool = False, failing_recv: bool = False):
        ours, self.theirs = multiprocessing.Pipe()
        self.child: multiprocessing.process.BaseProcess | None = None
        if real_child:
            self.child = multiprocessing.get_context("fork").Process(target=play_engine, args=(self.theirs,))
            self.child.start()
            self.theirs.close()
            process: Any = self.child
        else:
            self.player = threading.Thread(target=play_engine, args=(self.theirs,), daemon=True)
            self.player.start()
            process = SimpleNamespace(
                pid=1,
                exitcode=None,
                join=lambda timeout=None: None,
                is_alive=lambda: False,
                terminate=lambda: None,
            )
        self.connection = FailingConnection(ours) if failing_recv else ours
        self.failures: list[BaseException] = []
        self.client = EngineClient(
            process,
            self.connection,  # type: ignore[arg-type]
            ModelFacts(fake, frozenset(), 4),
            STATS,
            TextRules((), ""),
            self.failures.append,
        )

    def close(self) -> None:
        self.client.stop(timeout=10)
        if self.child is not None and self.child.is_alive():
            self.child.kill()


def request(index: int) -> Prepared:
    return Prepared(
        GenerationRequest(f"r{index}", (1, 2, 3), SamplingOptions(max_tokens=50), time.monotonic()), []
    )


async def every_stream_ends(harness: Harness, end_the_pipe: Callable[[], Any]) -> None:
    """Opens streams, ends the pipe with ``end_the_pipe``, and asserts each stream's last event is
    a failure and a later request is refused."""
    streams = [await harness.client.queue(request(i)) for i in range(STREAMS)]
    readers = [asyncio.ensure_future(_events(stream)) for stream in streams]
    await asyncio.sleep(0)  # every reader is waiting for its stream
    result = end_the_pipe()
    if asyncio.iscoroutine(result):
        await result
    done, hung = await asyncio.wait(readers, timeout=HUNG_S)
    assert not hung, f"{len(hung)} of {STREAMS} streams never ended"
    for reader in done:
        events = reader.result()
        assert isinstance(events[-1], Failed), events
    with pytest.raises(GenerationFailed):
        await harness.client.queue(request(STREAMS))


async def _events(stream: Any) -> list[Any]:
    return [event async for event in stream]


def device_failure_reported(harness: Harness) -> None:
    assert len(harness.failures) == 1, harness.failures
    assert harness.client.device_failure is not None


def test_the_pipe_closing_ends_every_stream(fake: Any) -> None:
    """The engine process closes its end (told to by a Stop the client itself never sent)."""
    harness = Harness(fake)
    try:
        asyncio.run(every_stream_ends(harness, lambda: harness.connection.send(Stop())))
        device_failure_reported(harness)
    finally:
        harness.close()


def test_a_failed_recv_ends_every_stream(fake: Any) -> None:
    """``recv()`` raising something other than EOF or OSError (injected)."""
    harness = Harness(fake, failing_recv=True)
    assert isinstance(harness.connection, FailingConnection)
    failing = harness.connection

    def fail() -> None:
        failing.fail.set()
        harness.theirs.send(StatsReport(STATS))  # the next message's recv() raises

    try:
        asyncio.run(every_stream_ends(harness, fail))
        device_failure_reported(harness)
    finally:
        harness.close()


def test_an_undecodable_message_ends_every_stream(fake: Any) -> None:
    harness = Harness(fake)
    try:
        asyncio.run(every_stream_ends(harness, lambda: harness.theirs.send_bytes(b"not a pickle")))
        device_failure_reported(harness)
    finally:
        harness.close()


def test_the_engine_process_dying_ends_every_stream(fake: Any) -> None:
    harness = Harness(fake, real_child=True)
    assert harness.child is not None and harness.child.pid is not None
    pid = harness.child.pid
    try:
        asyncio.run(every_stream_ends(harness, lambda: os.kill(pid, signal.SIGKILL)))
        device_failure_reported(harness)
        assert "status -9" in str(harness.client.device_failure)
    finally:
        harness.close()


def test_a_device_failure_ends_every_stream(fake: Any) -> None:
    """Even when the engine process could not fail its requests itself."""
    harness = Harness(fake)
    try:
        asyncio.run(every_stream_ends(harness, lambda: harness.theirs.send(EngineFailed("CUDA error"))))
        device_failure_reported(harness)
    finally:
        harness.close()


def test_stopping_the_engine_process_ends_every_stream_without_a_failure_report(fake: Any) -> None:
    harness = Harness(fake)
    try:
        asyncio.run(every_stream_ends(harness, lambda: asyncio.to_thread(harness.client.stop, 10)))
        assert harness.failures == [] and harness.client.device_failure is None
    finally:
        harness.close()
