"""Hundreds of HTTP clients disconnecting at random moments leave nothing behind.

Through a real edge and a real worker (``--fake-tokens``, 5 ms a step: the clean-up does not
depend on what streams, and slept steps cost no CPU), 300 raw-socket clients
each pick a moment to go away: while sending the request, right after
sending it (before the response headers), right after the headers (before
the first token), after a random number of chunks (mid-stream), while a
non-streaming answer is computed, or never (a control group that must get a
complete answer). Half close politely (FIN), half reset (RST). Requests mix
chat and multi-prompt text completions, streaming and not, ``n`` 1 and 2.

Afterwards the worker's own counters show nothing running, queued, cached or
reserved, every submitted request accounted for (finished or cancelled, none
failed) and no token being generated; the edge holds no open worker call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

CLIENTS = 300
CONCURRENCY = 40
MODES = ("partial_request", "before_headers", "before_first_token", "mid_stream", "non_streaming", "complete")
# Reproducible by default; SLUICE_FUZZ_SEED=<n> replays another run.
SEED = int(os.environ.get("SLUICE_FUZZ_SEED", "20240611"))


@pytest.fixture(scope="module")
def worker(
    model_cache: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    extra = ["--max-running", "16", "--fake-tokens", "--fake-step-ms", "5"]
    log_dir = tmp_path_factory.mktemp("fuzz-worker")
    with WorkerProcess(
        cache_dir=model_cache, log_dir=log_dir, model=str(tiny_model_dir), extra=extra
    ) as process:
        yield process


@pytest.fixture(scope="module")
def edge(worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProcess]:
    with EdgeProcess([worker.address], log_dir=tmp_path_factory.mktemp("fuzz-edge")) as process:
        yield process


def request_bytes(rng: random.Random, model: str, stream: bool, *, control: bool) -> tuple[bytes, int]:
    """A chat or a two-prompt text completion request as raw HTTP/1.1, and its number of worker
    calls (a two-prompt completion opens two).

    The control group's requests are short and ask the server to close the
    connection after the answer; every other request is long (close to the
    512-token context, two seconds or more of decoding), so one whose
    cancellation got lost would run to its end and show up as *finished* in
    the worker's counters.
    """
    common: dict[str, Any] = {
        "model": model,
        "stream": stream,
        "max_tokens": rng.randint(8, 60) if control else rng.randint(380, 440),
        "ignore_eos": True,
        "n": rng.choice((1, 1, 2)),
        "temperature": rng.choice((0, 0.8)),
    }
    if rng.random() < 0.7:
        path, calls = "/v1/chat/completions", 1
        body = {**common, "messages": [{"role": "user", "content": "Tell a story."}]}
    else:
        path, calls = "/v1/completions", 2
        body = {**common, "prompt": ["Once upon a time", "The river"]}
    payload = json.dumps(body).encode()
    connection = "Connection: close\r\n" if control else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n{connection}\r\n"
    )
    return head.encode() + payload, calls


async def one_client(rng: random.Random, port: int, model: str, mode: str) -> tuple[str, int]:
    """Runs one client in ``mode``; returns how it ended (for the tally) and how many worker
    calls it saw run to their end."""
    stream = mode in ("before_first_token", "mid_stream") or (mode != "non_streaming" and rng.random() < 0.5)
    request, calls = request_bytes(rng, model, stream, control=mode == "complete")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if mode == "partial_request":
            writer.write(request[: rng.randrange(1, len(request))])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.02))
        elif mode == "before_headers":
            writer.write(request)
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.03))
        elif mode == "non_streaming":
            writer.write(request)
            # Waits up to 0.6 s; on a fast machine a long answer may be complete by then.
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(reader.read(1), rng.uniform(0, 0.6)):
                    return "non_streaming: answered first", calls
        elif mode in ("before_first_token", "mid_stream"):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                return f"{mode}: {head.split(maxsplit=2)[1].decode()}", 0
            if mode == "mid_stream":
                wanted, data = rng.randint(1, 40), b""
                while data.count(b"data: {") < wanted:
                    piece = await reader.read(4096)
                    if not piece:
                        return "mid_stream: ended first", calls
                    data += piece
        else:  # complete: the control group reads the whole answer
            writer.write(request)
            answer = await reader.read(-1)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            assert (b"data: [DONE]" in answer) if stream else (b'"usage"' in answer), answer[-300:]
            return "complete: ok", calls
    finally:
        if rng.random() < 0.5:
            writer.transport.abort()  # RST
        else:
            writer.close()  # FIN
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    return mode, 0


def test_random_disconnects_leave_nothing_running(worker: WorkerProcess, edge: EdgeProcess) -> None:
    model = httpx.get(f"{edge.base_url}/v1/models").json()["data"][0]["id"]
    rng = random.Random(SEED)
    plan = [(random.Random(rng.random()), rng.choice(MODES)) for _ in range(CLIENTS)]
    before = worker.metrics()

    async def scenario() -> list[tuple[str, int]]:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def limited(client_rng: random.Random, mode: str) -> tuple[str, int]:
            async with gate:
                await asyncio.sleep(client_rng.uniform(0, 0.01))
                return await one_client(client_rng, edge.port, model, mode)

        return await asyncio.gather(*(limited(r, m) for r, m in plan))

    began = time.monotonic()
    results = asyncio.run(scenario())
    tally = collections.Counter(outcome for outcome, _ in results)
    finished_calls = sum(calls for _, calls in results)
    ran_s = time.monotonic() - began
    print(f"seed {SEED}: {CLIENTS} clients in {ran_s:.1f} s: {dict(sorted(tally.items()))}")
    assert tally["complete: ok"] == sum(1 for _, mode in plan if mode == "complete")

    # Nothing left on the worker (its own counters) ...
    deadline = time.monotonic() + 15
    gauges = ("running_requests", "running_sequences", "queue_depth", "live_caches", "reserved_tokens")
    while True:
        values = worker.metrics()
        if all(values[f"sluice_worker_{g}"] == 0 for g in gauges):
            break
        assert time.monotonic() < deadline, {g: values[f"sluice_worker_{g}"] for g in gauges}
        time.sleep(0.05)
    settled_s = time.monotonic() - began - ran_s
    print(f"worker idle {settled_s:.2f} s after the last client went away")
    generated = values["sluice_worker_generated_tokens_total"]
    time.sleep(0.5)
    after = worker.metrics()
    assert after["sluice_worker_generated_tokens_total"] == generated

    def delta(name: str) -> float:
        return after[f"sluice_worker_{name}_total"] - before[f"sluice_worker_{name}_total"]

    print(
        f"worker: {delta('requests_submitted'):.0f} submitted, {delta('requests_finished'):.0f} finished, "
        f"{delta('requests_cancelled'):.0f} cancelled, {delta('generated_tokens'):.0f} tokens"
    )
    assert delta("requests_failed") == 0
    assert delta("requests_submitted") == delta("requests_finished") + delta("requests_cancelled")
    # Only the calls the clients saw end ran to their end; every other call that reached the
    # worker was cancelled (a lost cancellation would have finished its 400 tokens by now).
    assert delta("requests_finished") == finished_calls
    assert delta("requests_cancelled") >= CLIENTS // 4  # the fuzz really cut calls short
    # ... and no worker call left open on the edge.
    workers = httpx.get(f"{edge.base_url}/ready").json()["workers"]
    assert [w["outstanding"] for w in workers] == [0]
    log = edge.log_path.read_text()
    assert "Traceback" not in log, edge.log_tail()
