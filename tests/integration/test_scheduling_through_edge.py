"""The scheduling policy's bar through a real edge and a ``--fake-tokens`` worker (20 ms steps, 4
slots, ``--scheduling-policy fair``, two tenants from the edge's ``--api-keys-file``): a priority-0
request behind 16 queued priority-5 ones of its tenant gets its first token in under a quarter of
the time it takes on a ``--scheduling-policy fcfs`` worker (and an equal-priority one takes); a
tenant's 4 short requests behind another tenant's flood of 16 long ones see a mean time to first
token at most 3x their time alone, and the flood completes; equal priorities start by the deadline
their time limit gives. Queues are observed on the worker's metrics before each measured request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

SLOTS = 4
firsts: list[tuple[float, int | None]] = []  # when each request's first token came, with its timeout
MODEL = "SmolLM2-135M-Instruct"  # the fake worker names the default model
KEYS = {"team-a": "sk-team-a", "team-b": "sk-team-b"}


def stack(model_cache, tmp_path_factory, policy: str) -> Iterator[tuple[WorkerProcess, EdgeProcess]]:
    """A ``--fake-tokens`` worker under ``policy`` behind an edge knowing both tenants' keys."""
    logs = tmp_path_factory.mktemp(f"scheduling-{policy}")
    keys = logs / "keys"
    keys.write_text("".join(f"{key} tenant={tenant}\n" for tenant, key in KEYS.items()))
    worker_flags = ["--fake-tokens", "--fake-step-ms", "20", "--max-running", str(SLOTS)]
    with (
        WorkerProcess(
            cache_dir=model_cache, log_dir=logs, extra=[*worker_flags, "--scheduling-policy", policy]
        ) as worker,
        EdgeProcess([worker.address], log_dir=logs, extra=["--api-keys-file", str(keys)]) as edge,
    ):
        yield worker, edge


@pytest.fixture(scope="module")
def fleet(model_cache, tmp_path_factory) -> Iterator[tuple[WorkerProcess, EdgeProcess]]:
    yield from stack(model_cache, tmp_path_factory, "fair")


@pytest.fixture(scope="module")
def fcfs_fleet(model_cache, tmp_path_factory) -> Iterator[tuple[WorkerProcess, EdgeProcess]]:
    """The same stack under ``--scheduling-policy fcfs``: the bar's baseline."""
    yield from stack(model_cache, tmp_path_factory, "fcfs")


async def first_token_and_end(
    client: httpx.AsyncClient, tenant: str, max_tokens: int, priority: int = 0, time_limit: int | None = None
) -> tuple[float, int]:
    """Streams one completion (``time_limit``: its X-Sluice-Timeout): seconds to its first token, and
    its completion tokens."""
    body = {
        "model": MODEL,
        "prompt": "Tell me about the town.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "priority": priority,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began, first, tokens = time.monotonic(), None, 0
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    if time_limit is not None:
        headers["X-Sluice-Timeout"] = str(time_limit)
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"text":"' in line.replace(" ", ""):
                first = time.monotonic() - began
            if '"completion_tokens":' in line:
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0].split("}")[0])
    assert first is not None
    firsts.append((first + began, time_limit))
    return first, tokens


async def queue_reaches(worker: WorkerProcess, running: int, waiting: int) -> None:
    """Waits (bounded) until the worker's metrics show this many running and waiting requests."""
    for _ in range(600):
        metrics = await asyncio.to_thread(worker.metrics)
        if (metrics["sluice_worker_running_requests"], metrics["sluice_worker_queue_depth"]) == (
            running,
            waiting,
        ):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the worker never showed {running} running and {waiting} waiting: {metrics}")


# A queued request's tokens: the fcfs probe waits 4 rounds of them (2.6 s of 20 ms steps), the
# urgent one a step or two.
QUEUED_TOKENS = 32


async def behind_a_queue(worker: WorkerProcess, edge: EdgeProcess, probe_priority: int) -> float:
    """A probe's time to first token behind 4 running and 16 queued priority-5 requests of its tenant."""
    async with httpx.AsyncClient(base_url=edge.base_url, timeout=120) as client:
        await queue_reaches(worker, 0, 0)
        queued = [
            asyncio.create_task(first_token_and_end(client, "team-a", QUEUED_TOKENS, priority=5))
            for _ in range(20)
        ]
        await queue_reaches(worker, SLOTS, 16)
        first, _ = await first_token_and_end(client, "team-a", 4, priority=probe_priority)
        ends = await asyncio.gather(*queued)
    assert [tokens for _, tokens in ends] == [QUEUED_TOKENS] * 20
    return first


def test_a_higher_priority_request_gets_its_first_token_in_under_a_quarter_of_the_fcfs_time(
    fleet, fcfs_fleet
):
    worker, edge = fleet
    fcfs = asyncio.run(behind_a_queue(*fcfs_fleet, probe_priority=0))  # fcfs ignores priorities
    same = asyncio.run(behind_a_queue(worker, edge, probe_priority=5))  # equal priorities: arrival order
    urgent = asyncio.run(behind_a_queue(worker, edge, probe_priority=0))
    print(
        f"time to first token: {urgent:.3f} s at priority 0, {same:.3f} s at equal priority, "
        f"{fcfs:.3f} s under --scheduling-policy fcfs"
    )
    assert urgent < fcfs / 4 and urgent < same / 4, (urgent, same, fcfs)
    causes = worker.metrics()
    assert causes["sluice_worker_preemptions_by_cause_total"] >= 1


async def shorts_of_team_a(client: httpx.AsyncClient) -> float:
    """The mean time to first token of team-a's 4 short requests, sent together."""
    results = await asyncio.gather(*(first_token_and_end(client, "team-a", 4) for _ in range(4)))
    assert [tokens for _, tokens in results] == [4] * 4
    return sum(first for first, _ in results) / len(results)


async def fair_share(worker: WorkerProcess, edge: EdgeProcess) -> tuple[float, float]:
    async with httpx.AsyncClient(base_url=edge.base_url, timeout=120) as client:
        await queue_reaches(worker, 0, 0)
        alone = await shorts_of_team_a(client)
        flood = [asyncio.create_task(first_token_and_end(client, "team-b", 48)) for _ in range(16)]
        await queue_reaches(worker, SLOTS, 12)
        crowded = await shorts_of_team_a(client)
        ends = await asyncio.gather(*flood)
    assert [tokens for _, tokens in ends] == [48] * 16, "the flood did not complete"
    return alone, crowded


def test_a_tenants_short_requests_are_not_queued_behind_another_tenants_flood(fleet):
    worker, edge = fleet
    before = worker.metrics()
    alone, crowded = asyncio.run(fair_share(worker, edge))
    print(f"team-a's mean time to first token: {alone:.3f} s alone, {crowded:.3f} s behind the flood")
    assert crowded <= 3 * alone, (crowded, alone)
    after = worker.metrics()
    assert (
        after["sluice_worker_preemptions_by_cause_total"] > before["sluice_worker_preemptions_by_cause_total"]
    )


async def by_deadline(worker: WorkerProcess, edge: EdgeProcess) -> list[int | None]:
    """The timeouts of two queued equal-priority requests, in the order their first tokens came."""
    async with httpx.AsyncClient(base_url=edge.base_url, timeout=120) as client:
        await queue_reaches(worker, 0, 0)
        # Slots free 16 steps apart, so the two queued requests start one at a time.
        running = [
            asyncio.create_task(first_token_and_end(client, "team-a", 48 + 16 * i)) for i in range(SLOTS)
        ]
        await queue_reaches(worker, SLOTS, 0)
        late = asyncio.create_task(first_token_and_end(client, "team-a", 2, time_limit=600))
        await queue_reaches(worker, SLOTS, 1)
        soon = asyncio.create_task(first_token_and_end(client, "team-a", 2, time_limit=60))
        await queue_reaches(worker, SLOTS, 2)
        firsts.clear()
        await asyncio.gather(late, soon, *running)
    return [timeout for _, timeout in sorted(firsts) if timeout is not None]


def test_equal_priorities_start_earliest_deadline_first(fleet):
    worker, edge = fleet
    assert asyncio.run(by_deadline(worker, edge)) == [60, 600]
