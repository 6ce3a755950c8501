"""Graceful drain of a real edge process on SIGTERM, in front of a real worker process.

Order under test (docs/http.md, "Shutdown"): readiness flips to 503 and new
generations are refused at once while the listener stays open for the drain
delay; streams in flight keep streaming through the grace period and are then
ended with ``event: error`` (``server_shutting_down``) and ``data: [DONE]``;
the process exits 0 and the worker is left with nothing running.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

DRAIN_DELAY_S = 3.0  # long enough that the checks made while the listener is open finish on a busy machine
GRACE_S = 2.0


@pytest.fixture(scope="module")
def worker(
    model_cache: Path,
    long_tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    """No model (``--fake-tokens``, 10 ms a step): what streams does not matter, and a stream of
    4000 tokens lasts 40 s on a slept step rather than computing all the while."""
    extra = ["--max-running", "4", "--fake-tokens", "--fake-step-ms", "10"]
    log_dir = tmp_path_factory.mktemp("drain-worker")
    model = str(long_tiny_model_dir)
    with WorkerProcess(cache_dir=model_cache, log_dir=log_dir, model=model, extra=extra) as process:
        yield process


def start_edge(worker: WorkerProcess, log_dir: Path, drain_delay_s: float) -> EdgeProcess:
    extra = ["--drain-delay", str(drain_delay_s), "--graceful-timeout", str(GRACE_S)]
    edge = EdgeProcess([worker.address], log_dir=log_dir, extra=extra)
    edge.start()
    return edge


def accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def long_body(model: str, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Tell a very long story."}],
        "stream": stream,
        "max_tokens": 4000,
        "ignore_eos": True,
        "temperature": 0,
    }


def test_sigterm_drains_then_ends_streams_cleanly_and_exits_0(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    edge = start_edge(worker, tmp_path_factory.mktemp("drain-edge"), DRAIN_DELAY_S)
    base, url = edge.base_url, f"{edge.base_url}/v1/chat/completions"
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    before = worker.metrics()

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            plain = asyncio.create_task(client.post(url, json=long_body(model, stream=False)))
            async with client.stream("POST", url, json=long_body(model, stream=True)) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                while '"content":"' not in await anext(lines):
                    pass
                edge.signal(signal.SIGTERM)
                t0 = time.monotonic()
                async with httpx.AsyncClient(timeout=5) as fresh:  # new connections, as a balancer's
                    # The signal reaches the edge's loop a moment after kill() returns: a request
                    # already on its way can still be answered 200 (ci47), so wait for the flip.
                    ready = await fresh.get(f"{base}/ready")
                    while ready.status_code == 200 and time.monotonic() - t0 < DRAIN_DELAY_S / 2:
                        await asyncio.sleep(0.02)
                        ready = await fresh.get(f"{base}/ready")
                    assert ready.status_code == 503
                    assert ready.json()["error"]["code"] == "server_shutting_down"
                    refused = await fresh.post(url, json=long_body(model, stream=True))
                    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
                    assert refused.json()["error"]["code"] == "server_shutting_down"
                assert time.monotonic() - t0 < DRAIN_DELAY_S  # all of that while the listener is open
                after_signal = [line async for line in lines if line]
                ended_s = time.monotonic() - t0
            # The stream kept streaming after the signal, then ended with an error event and [DONE].
            content = [line for line in after_signal if line.startswith("data: {")]
            assert len(content) > 20
            assert after_signal[-3] == "event: error" and after_signal[-1] == "data: [DONE]"
            error = json.loads(after_signal[-2].removeprefix("data: "))["error"]
            assert error["code"] == "server_shutting_down"
            print(f"stream ended {ended_s:.2f} s after SIGTERM ({len(content)} chunks after it)")
            assert DRAIN_DELAY_S + GRACE_S - 0.5 < ended_s < DRAIN_DELAY_S + GRACE_S + 5
            answer = await plain
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "server_shutting_down"

    try:
        asyncio.run(scenario())
        assert not accepts_connections(edge.port)  # the listener is closed by now
        assert edge.proc is not None and edge.proc.wait(15) == 0
    finally:
        edge.stop()
    log = edge.log_path.read_text()
    assert "Traceback" not in log, edge.log_tail()
    assert "edge: " in log and "objects from start-up left out of garbage collection" in log
    settle_deadline = time.monotonic() + 10
    while (values := worker.metrics())[
        "sluice_worker_running_requests"
    ] and time.monotonic() < settle_deadline:
        time.sleep(0.05)
    assert values["sluice_worker_running_requests"] == 0 and values["sluice_worker_live_caches"] == 0
    cancelled = (
        values["sluice_worker_requests_cancelled_total"] - before["sluice_worker_requests_cancelled_total"]
    )
    assert cancelled == 2


def test_idle_edge_exits_after_the_drain_delay_and_a_second_signal_cuts_it_short(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    edge = start_edge(worker, tmp_path_factory.mktemp("drain-edge-idle"), DRAIN_DELAY_S)
    try:
        t0 = time.monotonic()
        edge.signal(signal.SIGTERM)
        time.sleep(0.3)
        assert accepts_connections(edge.port)  # still open during the delay
        assert edge.proc is not None and edge.proc.wait(15) == 0
        waited = time.monotonic() - t0
        print(f"idle edge exited {waited:.2f} s after SIGTERM (drain delay {DRAIN_DELAY_S} s)")
        assert DRAIN_DELAY_S <= waited < DRAIN_DELAY_S + 5
    finally:
        edge.stop()

    patient = start_edge(worker, tmp_path_factory.mktemp("drain-edge-twice"), 60.0)
    try:
        t0 = time.monotonic()
        patient.signal(signal.SIGTERM)
        time.sleep(0.3)
        patient.signal(signal.SIGTERM)
        assert patient.proc is not None and patient.proc.wait(15) == 0
        print(f"a second SIGTERM ended a 60 s drain delay after {time.monotonic() - t0:.2f} s")
    finally:
        patient.stop()
