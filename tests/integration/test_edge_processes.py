"""An edge with ``--processes 2`` (two processes on one port) in front of a real fake-token worker:
it serves streams, ``/metrics`` from either process reports both, and SIGTERM stops both cleanly."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

STREAMS = 12
BODY = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "Tell me about the town."}],
    "max_tokens": 24,
    "stream": True,
}


def children_of(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def one_stream(base: str) -> str:
    # A client of its own, so a connection of its own: the kernel spreads connections over the
    # processes (SO_REUSEPORT), not requests.
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(f"{base}/v1/chat/completions", json=BODY)
        assert response.status_code == 200
        return response.text


async def scrape(base: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"{base}/metrics")
        assert response.status_code == 200
        return samples(response.text)


def test_two_processes_serve_streams_and_report_metrics_as_one(model_cache, tmp_path_factory):
    with (
        WorkerProcess(
            cache_dir=model_cache,
            log_dir=tmp_path_factory.mktemp("worker-log"),
            extra=["--fake-tokens", "--max-running", "32"],
        ) as worker,
        EdgeProcess(
            [worker.address], log_dir=tmp_path_factory.mktemp("edge-log"), extra=["--processes", "2"]
        ) as edge,
    ):
        assert edge.proc is not None
        assert len(children_of(edge.proc.pid)) == 2

        async def body() -> list[dict[str, float]]:
            texts = await asyncio.gather(*(one_stream(edge.base_url) for _ in range(STREAMS)))
            assert all(t.endswith("data: [DONE]\n\n") and "event: error" not in t for t in texts)
            return [await scrape(edge.base_url) for _ in range(8)]

        scrapes = asyncio.run(body())
        chat_200 = 'sluice_edge_requests_total{route="/v1/chat/completions",status="200"}'
        for seen in scrapes:
            # Whichever process answered, it reports every stream of both processes.
            assert seen[chat_200] == STREAMS
            assert seen['sluice_edge_time_to_first_token_seconds_count{surface="openai"}'] == STREAMS
            assert seen['sluice_edge_streams_in_flight{surface="openai"}'] == 0
            assert seen[f'sluice_edge_worker_up{{address="{worker.address}"}}'] == 1
        # The scrapes count too (each after it answered): whichever process answered, it saw all before.
        metrics_200 = 'sluice_edge_requests_total{route="/metrics",status="200"}'
        assert [s.get(metrics_200, 0) for s in scrapes] == list(range(8))

        edge.signal(signal.SIGTERM)
        assert edge.wait_exit(30) == 0
