"""Backpressure, memory bounds, metrics and cancellation at random moments, on a real worker process."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import httpx
import pytest

from sluice.status import read_details
from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def small_worker(model_cache, tmp_path_factory):
    """One sequence at a time, two waiting at most, 2000 tokens of cache; no model (``--fake-tokens``
    with 20 ms steps, so calls overlap): the limits are the scheduler's, whatever the model."""
    fake = ["--fake-tokens", "--fake-step-ms", "20"]
    extra = [*fake, "--max-running", "1", "--max-queue", "2", "--max-batch-tokens", "2000"]
    log_dir = tmp_path_factory.mktemp("small")
    with WorkerProcess(cache_dir=model_cache, log_dir=log_dir, extra=extra) as worker:
        yield worker


@pytest.fixture(scope="module")
def fake_worker(model_cache, tmp_path_factory):
    """The default limits, no model (``--fake-tokens`` with 5 ms steps): cancellations at random
    moments meet the scheduler's and the server's paths, whatever computes the logits, without
    200 prompts computed by the default model."""
    extra = ["--fake-tokens", "--fake-step-ms", "5"]
    with WorkerProcess(cache_dir=model_cache, log_dir=tmp_path_factory.mktemp("fake"), extra=extra) as worker:
        yield worker


def chat(text: str, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=text)]),
        sampling=pb.SamplingParams(**sampling),
    )


def settle(worker: WorkerProcess, timeout: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = worker.metrics()
        idle = metrics["sluice_worker_running_requests"] == 0 and metrics["sluice_worker_queue_depth"] == 0
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def test_full_queue_is_resource_exhausted_with_a_retry_hint(small_worker):
    async def scenario() -> list[grpc.aio.AioRpcError | None]:
        async with grpc.aio.insecure_channel(small_worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)

            async def one() -> grpc.aio.AioRpcError | None:
                try:
                    async for _ in stub.Generate(chat("Tell a long story.", max_tokens=12, ignore_eos=True)):
                        pass
                except grpc.aio.AioRpcError as error:
                    return error
                return None

            return await asyncio.gather(*[one() for _ in range(6)])

    outcomes = asyncio.run(scenario())
    refused = [e for e in outcomes if e is not None]
    assert refused, "1 running + 2 queued: some of 6 simultaneous calls must be refused"
    assert sum(e is None for e in outcomes) >= 3
    for error in refused:
        details = read_details(error)
        assert details.code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.reason == "queue_full"
        assert details.retry_after_seconds and details.retry_after_seconds > 0


def test_request_larger_than_the_cache_bound_is_refused_naming_max_tokens(small_worker):
    with grpc.insecure_channel(small_worker.address) as channel, pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.WorkerStub(channel).Generate(chat("hi", max_tokens=3000)))
    details = read_details(info.value)
    assert details.code == grpc.StatusCode.INVALID_ARGUMENT and details.param == "max_tokens"


def test_the_edge_refuses_n_above_what_the_worker_serves_naming_n_and_the_limit(small_worker, tmp_path):
    with grpc.insecure_channel(small_worker.address) as channel:
        (model,) = pb_grpc.WorkerStub(channel).ListModels(pb.ListModelsRequest()).models
    assert model.max_n == 1  # --max-running 1
    with EdgeProcess([small_worker.address], log_dir=tmp_path) as edge:
        body = {"model": model.id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        reply = httpx.post(f"{edge.base_url}/v1/chat/completions", json={**body, "n": 2}, timeout=30)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["code"]) == ("n", "invalid_value")
        assert "'n'" in error["message"] and "at most 1" in error["message"], error["message"]


def test_metrics_report_ttft_histogram_and_cache(default_worker):
    with grpc.insecure_channel(default_worker.address) as channel:
        list(pb_grpc.WorkerStub(channel).Generate(chat("Hello!", max_tokens=3)))
    metrics = settle(default_worker)
    assert metrics["sluice_worker_time_to_first_token_seconds_count"] >= 1
    assert metrics["sluice_worker_time_to_first_token_seconds_sum"] > 0
    assert metrics["sluice_worker_kv_cache_tokens"] == 0 and metrics["sluice_worker_reserved_tokens"] == 0


def test_hundreds_of_random_cancellations_leave_nothing_running(fake_worker):
    rng = random.Random(7)
    before = fake_worker.metrics()

    async def scenario() -> int:
        async with grpc.aio.insecure_channel(fake_worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)

            async def one(i: int) -> bool:
                call = stub.Generate(chat(f"Story number {i}, please.", max_tokens=500, ignore_eos=True))
                stop_after = rng.choice([0, 0, 1, 2, 3, 5, 8])
                if stop_after == 0:
                    await asyncio.sleep(rng.random() * 0.05)  # cancel before (or while) it is queued
                    call.cancel()
                    return True
                seen = 0
                async for event in call:
                    seen += event.HasField("content")
                    if seen >= stop_after:
                        call.cancel()
                        return True
                return False

            results = await asyncio.gather(*[one(i) for i in range(200)], return_exceptions=True)
            return sum(1 for r in results if r is True)

    cancelled = asyncio.run(scenario())
    assert cancelled == 200
    metrics = settle(fake_worker, timeout=60)
    assert metrics["sluice_worker_running_sequences"] == 0 and metrics["sluice_worker_queue_depth"] == 0
    # Every block is back (the pool itself, allocated at start, stays).
    assert metrics["sluice_worker_live_caches"] == 0 and metrics["sluice_worker_kv_cache_blocks_used"] == 0

    def delta(name: str) -> float:
        return metrics[f"sluice_worker_{name}"] - before[f"sluice_worker_{name}"]

    gone = delta("requests_cancelled_total") + delta("requests_finished_total")
    assert delta("requests_submitted_total") == gone, "every submitted request was cancelled or finished"
    generated = delta("generated_tokens_total")
    assert generated < 200 * 40, f"{generated} tokens: cancelled requests kept generating"
