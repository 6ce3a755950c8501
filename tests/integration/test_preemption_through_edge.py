"""A worker short of KV blocks, through the edge: concurrent ``n`` > 1 completions are preempted and
recomputed, every one of them finishes, and the worker answers a new request at once afterwards."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

# 40 blocks of 16 tokens and a 64-token prefill budget (the tiny model keeps the test quick; the
# default model with --quantization none --kv-cache-bytes 29500000 gives the same pool): an n = 2 or
# 3 request with a 70-120 token prompt cannot recompute all its choices in one step.
SMALL_POOL = ["--max-batch-tokens", "640", "--max-prefill-tokens", "64"]
WORDS = [
    "river",
    "mill",
    "bread",
    "town",
    "water",
    "clerk",
    "morning",
    "coffee",
    "north",
    "steps",
    "shutters",
    "baker",
    "change",
]


@pytest.fixture(scope="module")
def crowded(model_cache, tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("crowded")
    with (
        WorkerProcess(
            cache_dir=model_cache, log_dir=logs, model=str(tiny_model_dir), extra=SMALL_POOL
        ) as worker,
        EdgeProcess([worker.address], log_dir=logs) as edge,
    ):
        yield worker, edge


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(70, 110)))


async def complete(client: httpx.AsyncClient, text: str, n: int, max_tokens: int) -> dict:
    model = (await client.get("/v1/models")).json()["data"][0]["id"]
    body = {"model": model, "prompt": text, "n": n, "max_tokens": max_tokens}
    response = await client.post("/v1/completions", json={**body, "ignore_eos": True, "temperature": 0.8})
    assert response.status_code == 200, response.text
    return response.json()


def test_crowded_n_requests_all_finish_and_a_new_request_is_served_at_once(crowded):
    worker, edge = crowded
    rng = random.Random(30)
    requests = [(prompt(rng), 2 + i % 2) for i in range(10)]

    async def scenario() -> tuple[list[dict], dict, float]:
        async with httpx.AsyncClient(base_url=edge.base_url, timeout=300) as client:
            answers = await asyncio.gather(*[complete(client, text, n, 60) for text, n in requests])
            started = time.monotonic()
            small = await complete(client, "Hello", 1, 2)
            return answers, small, time.monotonic() - started

    answers, small, latency = asyncio.run(scenario())
    for (_, n), answer in zip(requests, answers, strict=True):
        assert len(answer["choices"]) == n
        assert {c["finish_reason"] for c in answer["choices"]} == {"length"}
        assert answer["usage"]["completion_tokens"] == 60 * n
    assert small["usage"]["completion_tokens"] == 2
    print(f"a 2-token request after the crowd: {latency:.3f} s")
    metrics = worker.metrics()
    assert metrics["sluice_worker_preemptions_total"] > 0  # the scenario did crowd the pool
    assert metrics["sluice_worker_running_requests"] == 0 and metrics["sluice_worker_queue_depth"] == 0
