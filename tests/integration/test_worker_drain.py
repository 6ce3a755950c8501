"""Worker drain on SIGTERM, on a real worker process: health flips first, new calls are refused,
in-flight calls finish within the grace period, or end with UNAVAILABLE when it runs out."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from sluice.client import ServingStatus, WorkerCallError, WorkerClient
from sluice.v1 import worker_pb2 as pb
from tests.processes import WorkerProcess

pytestmark = pytest.mark.integration


def worker_with_grace(model: Path, cache: Path, log_dir: Path, grace_s: float) -> WorkerProcess:
    """A worker to use in ``with`` (stopped on the way out if a test failed before it exited). No
    model (``--fake-tokens``, 10 ms a step): a drain does not depend on what streams, and a long
    call lasts seconds on a slept step rather than computing all the while."""
    extra = ["--grace-period", str(grace_s), "--fake-tokens", "--fake-step-ms", "10"]
    return WorkerProcess(cache_dir=cache, log_dir=log_dir, model=str(model), extra=extra)


def long_request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Tell me a long story.")]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )


def test_sigterm_refuses_new_calls_and_lets_in_flight_ones_finish(
    long_tiny_model_dir: Path, model_cache: Path, tmp_path: Path
) -> None:
    with worker_with_grace(long_tiny_model_dir, model_cache, tmp_path, grace_s=60) as worker:

        async def scenario() -> tuple[list[str | None], float]:
            async with WorkerClient(worker.address) as client:
                kinds: list[str | None] = []
                # 2 s of 10 ms steps: the checks below run while it streams, and over 100 of its tokens come.
                async with client.generate(long_request(200), timeout=60) as stream:
                    async for event in stream:
                        kinds.append(event.WhichOneof("event"))
                        if len(kinds) == 3:
                            worker.signal(signal.SIGTERM)
                            signalled = time.monotonic()
                            # Health flips first (once the signal reaches the worker's loop, a moment
                            # after kill() returns), then new calls are refused with a clear UNAVAILABLE.
                            health = await client.health()
                            while health is ServingStatus.SERVING and time.monotonic() - signalled < 0.5:
                                await asyncio.sleep(0.01)
                                health = await client.health()
                            assert health is ServingStatus.NOT_SERVING
                            assert await client.health("") is ServingStatus.NOT_SERVING
                            with pytest.raises(WorkerCallError) as refused:
                                await client.generate(long_request(5), timeout=10).read()
                            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                            assert (
                                refused.value.reason == "not_ready"
                                and "shutting down" in refused.value.message
                            )
                return kinds, signalled

        kinds, signalled = asyncio.run(scenario())
        # The stream that was running when the signal came finished normally.
        assert kinds[-2:] == ["finished", "usage"] and kinds.count("content") > 100
        exit_code = worker.wait_exit(30)
        print(f"worker exited {time.monotonic() - signalled:.2f} s after SIGTERM (grace 60 s)")
        assert exit_code == 0  # without waiting for the whole grace period
        assert "draining" in worker.log_tail() and "every in-flight call finished" in worker.log_tail()


def test_in_flight_call_still_running_when_the_grace_ends_gets_unavailable(
    long_tiny_model_dir: Path, model_cache: Path, tmp_path: Path
) -> None:
    grace_s = 1.0
    with worker_with_grace(long_tiny_model_dir, model_cache, tmp_path, grace_s=grace_s) as worker:

        async def scenario() -> tuple[WorkerCallError, float, int]:
            async with WorkerClient(worker.address) as client:
                events = 0
                try:
                    async for _ in client.generate(long_request(3500), timeout=120):
                        events += 1
                        if events == 3:
                            worker.signal(signal.SIGTERM)
                            signalled = time.monotonic()
                except WorkerCallError as error:
                    return error, time.monotonic() - signalled, events
                raise AssertionError("the stream outlived the grace period")

        error, delay, events = asyncio.run(scenario())
        print(f"stream ended {delay:.2f} s after SIGTERM (grace {grace_s} s), after {events} events: {error}")
        assert error.code() == grpc.StatusCode.UNAVAILABLE  # not a bare CANCELLED
        assert error.reason == "not_ready" and "shutting down" in error.message
        assert grace_s <= delay < grace_s + 5.0
        assert worker.wait_exit(15) == 0
