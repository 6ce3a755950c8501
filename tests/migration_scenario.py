"""A worker SIGKILLed under streams that all run on it, behind an edge with a second worker.

Used by the integration test (``tests/integration/test_stream_migration.py``,
a few short streams) and once by the retired benchmark script (``bench/bench_migration.py``,
the issue's bar: 6 greedy streams of 400 tokens; docs/benchmarks.md "Retired scripts"). Both
run real worker and edge processes on 127.0.0.1 and read the streams with the official ``openai`` SDK.

The scenario: the streams run once undisturbed (the reference texts); then
worker B is paused (SIGSTOP) until the edge ejects it, so every new stream goes
to worker A; the streams start; once each has output, B resumes (SIGCONT) and
the edge takes it back; A is SIGKILLed. Every stream must then end normally
(finish reason, usage, no error) with exactly its reference text.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from dataclasses import dataclass, field

import httpx
from openai import AsyncOpenAI

from tests.processes import EdgeProcess, WorkerProcess

# Edge flags: notice a paused or dead worker, and a restored one, within a second.
EDGE_FLAGS = ["--health-interval", "0.5", "--health-timeout", "1"]


def counting_prompt(start: int) -> str:
    """A prompt the default model answers at length and deterministically (greedy)."""
    return f"Count from {start} to 2000, one number after another, separated by commas. Do not stop."


@dataclass
class StreamResult:
    """What one client read."""

    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each content chunk
    ended_at: float | None = None
    flowing: asyncio.Event = field(default_factory=asyncio.Event)


async def read_stream(
    client: AsyncOpenAI, prompt: str, max_tokens: int, result: StreamResult, *, ignore_eos: bool = False
) -> StreamResult:
    """One greedy streamed chat completion with usage; raises if the stream carries an error."""
    stream = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        # ignore_eos: every stream runs to max_tokens (past the model's end, where near-ties are many).
        extra_body={"ignore_eos": ignore_eos},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            result.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                result.text += choice.delta.content
                result.chunks += 1
                result.arrivals.append(time.monotonic())
                if result.chunks >= 3:
                    result.flowing.set()
            if choice.finish_reason:
                result.finish_reason = choice.finish_reason
    result.ended_at = time.monotonic()
    result.flowing.set()
    return result


async def wait_worker_status(edge: EdgeProcess, address: str, serving: bool) -> None:
    """Waits (30 s at most) until the edge's /ready lists ``address`` as SERVING (or as not)."""
    async with asyncio.timeout(30), httpx.AsyncClient(timeout=5.0) as http:
        while True:
            workers = (await http.get(f"{edge.base_url}/ready")).json()["workers"]
            status = {w["address"]: w["status"] for w in workers}.get(address)
            if (status == "SERVING") == serving:
                return
            await asyncio.sleep(0.1)


@dataclass
class ScenarioResult:
    undisturbed: list[StreamResult]
    disturbed: list[StreamResult]
    killed_at: float
    migrations: dict[str, float]

    def stall_after_kill(self, index: int) -> float | None:
        """Seconds between stream ``index``'s last chunk before the kill and its first one after."""
        arrivals = self.disturbed[index].arrivals
        before = [t for t in arrivals if t <= self.killed_at]
        after = [t for t in arrivals if t > self.killed_at]
        return after[0] - before[-1] if before and after else None


def migration_counts(edge: EdgeProcess) -> dict[str, float]:
    """``sluice_edge_stream_migrations_total`` by outcome, from the edge's /metrics."""
    text = httpx.get(f"{edge.base_url}/metrics", timeout=5).text
    counts = {}
    for line in text.splitlines():
        match = re.fullmatch(r'sluice_edge_stream_migrations_total\{outcome="(\w+)"\} (\S+)', line)
        if match:
            counts[match.group(1)] = float(match.group(2))
    return counts


async def kill_under_streams(
    edge: EdgeProcess,
    victim: WorkerProcess,
    survivor: WorkerProcess,
    streams: int,
    max_tokens: int,
    *,
    ignore_eos: bool = False,
    kill_after_chunks: int = 0,
) -> ScenarioResult:
    """Runs the scenario in the module docstring; returns what every client read. ``ignore_eos``:
    every stream runs to ``max_tokens`` (the bench's bar); ``kill_after_chunks``: A is killed only
    once every stream read that many content chunks (or ended), so the move carries that much."""
    prompts = [counting_prompt(1 + 37 * i) for i in range(streams)]
    client = AsyncOpenAI(base_url=f"{edge.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        undisturbed = await asyncio.gather(
            *(read_stream(client, p, max_tokens, StreamResult(), ignore_eos=ignore_eos) for p in prompts)
        )

        survivor.signal(signal.SIGSTOP)  # the edge ejects it: every new stream goes to the victim
        try:
            await wait_worker_status(edge, survivor.address, serving=False)
            results = [StreamResult() for _ in prompts]
            tasks = [
                asyncio.create_task(read_stream(client, p, max_tokens, r, ignore_eos=ignore_eos))
                for p, r in zip(prompts, results, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(r.flowing.wait() for r in results)), 300)
        finally:
            survivor.signal(signal.SIGCONT)
        await wait_worker_status(edge, survivor.address, serving=True)
        # A condition over every stream's counter: polled.
        while not all(r.chunks >= kill_after_chunks or r.ended_at is not None for r in results):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        killed_at = time.monotonic()
        victim.kill()
        disturbed = await asyncio.wait_for(asyncio.gather(*tasks), 600)
    finally:
        await client.close()
    return ScenarioResult(list(undisturbed), list(disturbed), killed_at, migration_counts(edge))
