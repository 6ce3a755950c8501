"""Worker faults behind a real edge: a worker SIGKILLed mid-stream, restarted, DNS discovery, all down.

Real worker and edge processes on 127.0.0.1, real gRPC and HTTP. The workers run no model
(``--fake-tokens``: what they stream does not matter here) and each step takes
``--fake-step-ms`` of sleep, so a stream of :data:`LONG` tokens lasts seconds whatever the load,
long enough to kill a worker in the middle of it, for little CPU.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.processes import EdgeProcess, LiveEdgeProcess, WorkerProcess, free_port

pytestmark = pytest.mark.integration

STEP_MS = 20
WORKER_FLAGS = [
    "--max-running",
    "8",
    "--served-model-name",
    "fake",
    "--fake-tokens",
    "--fake-step-ms",
    str(STEP_MS),
]
# Without stream migration: a killed worker's streams end with the error event (with migration,
# its default, they move to the other worker: tests/integration/test_stream_migration.py).
# least-outstanding: these scenarios send the same prompt again and again and count on the load,
# not on prefix affinity (the default), to spread it over both workers.
EDGE_FLAGS = [
    "--health-interval",
    "0.5",
    "--health-timeout",
    "1",
    "--migrate-streams",
    "false",
    "--routing",
    "least-outstanding",
]
# Long enough that no stream can end before the kill: at least 3 s, a step's sleep per token.
LONG = 150


@pytest.fixture(scope="module")
def two_workers(
    tiny_model_dir: Path, model_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    logs = tmp_path_factory.mktemp("fault-workers")
    workers = []
    for worker_id in ("A", "B"):
        (logs / worker_id).mkdir()
        extra = [*WORKER_FLAGS, "--worker-id", worker_id]
        workers.append(
            WorkerProcess(
                cache_dir=model_cache, log_dir=logs / worker_id, model=str(tiny_model_dir), extra=extra
            )
        )
    a, b = workers
    with a, b:
        yield a, b


def body(max_tokens: int, stream: bool = True) -> dict[str, object]:
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


@dataclass
class StreamLog:
    """What one HTTP stream received, with the arrival time of its last frames."""

    worker: str = ""
    contents: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    error: dict[str, object] | None = None
    error_at: float | None = None
    done_at: float | None = None
    flowing: asyncio.Event = field(default_factory=asyncio.Event)


async def read_stream(client: httpx.AsyncClient, url: str, log: StreamLog) -> None:
    async with client.stream("POST", url, json=body(LONG)) as response:
        assert response.status_code == 200, await response.aread()
        log.worker = response.headers["x-sluice-worker-id"]
        saw_error_event = False
        async for line in response.aiter_lines():
            if line == "event: error":
                saw_error_event = True
            elif line == "data: [DONE]":
                log.done_at = time.monotonic()
            elif line.startswith("data: "):
                payload = json.loads(line[len("data: ") :])
                if saw_error_event and "error" in payload:
                    log.error, log.error_at = payload["error"], time.monotonic()
                    continue
                for choice in payload.get("choices", []):
                    if choice["delta"].get("content"):
                        log.contents += 1
                        if log.contents >= 3:
                            log.flowing.set()
                    if choice.get("finish_reason"):
                        log.finish_reasons.append(choice["finish_reason"])


async def served_by(client: httpx.AsyncClient, url: str) -> str:
    """One short non-streaming request; asserts it succeeded and returns its worker id."""
    response = await client.post(url, json=body(4, stream=False))
    assert response.status_code == 200, response.text
    return response.headers["x-sluice-worker-id"]


def test_worker_killed_mid_stream_then_restarted(two_workers, tmp_path: Path) -> None:
    a, b = two_workers
    with EdgeProcess([a.address, b.address], log_dir=tmp_path, extra=EDGE_FLAGS) as edge:
        url = f"{edge.base_url}/v1/chat/completions"

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
                logs = [StreamLog() for _ in range(4)]
                tasks = [asyncio.create_task(read_stream(client, url, log)) for log in logs]
                await asyncio.wait_for(asyncio.gather(*(log.flowing.wait() for log in logs)), 30)
                by_worker = {w: [log for log in logs if log.worker == w] for w in ("A", "B")}
                assert by_worker["A"] and by_worker["B"], [log.worker for log in logs]

                killed_at = time.monotonic()
                a.kill()
                await asyncio.wait_for(asyncio.gather(*tasks), 60)

                for log in by_worker["A"]:
                    assert log.error is not None and log.error_at is not None and log.done_at is not None
                    assert log.error["type"] == "server_error"
                    error_delay, done_delay = log.error_at - killed_at, log.done_at - killed_at
                    print(
                        f"killed worker's stream: error after {error_delay:.3f} s, [DONE] {done_delay:.3f} s"
                    )
                    assert done_delay < 5.0
                for log in by_worker["B"]:
                    assert log.error is None and log.done_at is not None
                    assert log.finish_reasons == ["length"] and log.contents > 3

                # The survivor takes everything, no errors, no hangs.
                started = time.monotonic()
                ids = await asyncio.wait_for(asyncio.gather(*(served_by(client, url) for _ in range(6))), 30)
                assert ids == ["B"] * 6
                print(f"6 requests on the survivor in {time.monotonic() - started:.2f} s")
                ready = (await client.get(f"{edge.base_url}/ready")).json()
                assert {w["address"]: w["status"] for w in ready["workers"]}[a.address] == "UNREACHABLE"

                # The killed worker comes back on the same port and is taken back.
                a.start()
                restarted_at = time.monotonic()
                seen: set[str] = set()
                while "A" not in seen:
                    assert time.monotonic() - restarted_at < 30, "the restarted worker was never used"
                    seen.update(await asyncio.gather(*(served_by(client, url) for _ in range(2))))
                    await asyncio.sleep(0.2)
                print(
                    f"restarted worker served again {time.monotonic() - restarted_at:.2f} s after it was up"
                )
                ready = (await client.get(f"{edge.base_url}/ready")).json()
                assert all(w["status"] == "SERVING" for w in ready["workers"])

        asyncio.run(scenario())


def test_worker_dns_name_is_resolved_and_used(two_workers, tmp_path: Path) -> None:
    _, b = two_workers
    with EdgeProcess(
        [], log_dir=tmp_path, extra=[*EDGE_FLAGS, "--worker-dns", f"localhost:{b.port}"]
    ) as edge:
        response = httpx.post(f"{edge.base_url}/v1/chat/completions", json=body(4, stream=False), timeout=30)
        assert response.status_code == 200, response.text
        assert response.headers["x-sluice-worker-id"] == "B"
        ready = httpx.get(f"{edge.base_url}/ready", timeout=10).json()
        assert {w["address"]: w["status"] for w in ready["workers"]}[b.address] == "SERVING"


def test_every_worker_down_is_a_fast_503(tmp_path: Path) -> None:
    dead = free_port()
    extra = [*EDGE_FLAGS, "--worker-dns", f"localhost:{dead}", "--worker-connect-timeout", "10"]
    with LiveEdgeProcess([], log_dir=tmp_path, extra=extra) as edge:
        deadline = time.monotonic() + 10
        while httpx.get(f"{edge.base_url}/ready", timeout=10).json()["workers"] == []:
            assert time.monotonic() < deadline, "the DNS name was never resolved"
            time.sleep(0.1)
        ready = httpx.get(f"{edge.base_url}/ready", timeout=10)
        assert ready.status_code == 503
        assert f"127.0.0.1:{dead}" in [w["address"] for w in ready.json()["workers"]]
        for _ in range(3):
            started = time.monotonic()
            response = httpx.post(f"{edge.base_url}/v1/chat/completions", json=body(4), timeout=30)
            elapsed = time.monotonic() - started
            print(f"503 in {elapsed:.3f} s")
            assert response.status_code == 503
            assert response.headers["content-type"] == "application/json"
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["type"] == "server_error"
            assert elapsed < 5.0  # far below the 10 s connect timeout: no worker was waited for
