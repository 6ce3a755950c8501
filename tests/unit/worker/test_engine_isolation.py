"""One failure fails one request: output processing, sampling and forward failures on a tiny random Llama."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tests.unit.worker.test_engine import greedy, make_engine
from worker.engine import request_stream as stream_module
from worker.model.loader import load_model
from worker.output.processor import RequestOutputProcessor
from worker.types import ContentDelta, Failed, Finished, GenerationRequest, SamplingOptions, Usage

STEPS = 10
LONG = 300


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


def request(name: str, prompt: list[int]) -> GenerationRequest:
    sampling = SamplingOptions(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS)
    return GenerationRequest(name, tuple(prompt), sampling, time.monotonic(), return_token_ids=True)


def ids(events: list) -> list[int]:
    return [t for e in events if isinstance(e, ContentDelta) for t in e.token_ids]


class PoisonedProcessor(RequestOutputProcessor):
    """Raises for the request named "poison" once it has three tokens, as a parser bug would."""

    def __init__(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(request, *args, **kwargs)
        self._poisoned = request.request_id == "poison"

    def process(self, outputs):  # type: ignore[no-untyped-def]
        if self._poisoned and self.usage().completion_tokens >= 3:
            raise ValueError("parser bug")
        return super().process(outputs)


def test_a_failing_output_processor_fails_its_request_only(loaded, monkeypatch):
    monkeypatch.setattr(stream_module, "RequestOutputProcessor", PoisonedProcessor)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(2, 30))] for _ in range(9)]
    eng = make_engine(loaded, prefill_budget_tokens=512, prefix_caching=True, max_running=9)

    async def collect(name: str, prompt: list[int]) -> list:
        return [event async for event in eng.submit(request(name, prompt))]

    async def run_all() -> list[list]:
        names = ["poison" if i == 4 else f"r{i}" for i in range(9)]
        return await asyncio.gather(*[collect(n, p) for n, p in zip(names, prompts, strict=True)])

    try:
        cached_before = eng.blocks.cached_length(prompts[0])
        results = asyncio.run(asyncio.wait_for(run_all(), timeout=120))
        for i, (prompt, events) in enumerate(zip(prompts, results, strict=True)):
            if i == 4:
                failed = events[-1]
                assert isinstance(failed, Failed) and failed.message == "output processing failed: ValueError"
                assert failed.usage is not None and failed.usage.prompt_tokens == len(prompt)
                assert 0 < failed.usage.completion_tokens < STEPS
                continue
            assert ids(events) == greedy(loaded, prompt, STEPS), i
            assert isinstance(events[-1], Usage) and events[-1].completion_tokens == STEPS
        stats = eng.stats()
        assert stats.counters.requests_failed == 1 and stats.counters.requests_finished == 8
        assert stats.running_requests == 0 and stats.live_caches == 0
        # No cache was dropped: the prompts' blocks are still there.
        assert eng.blocks.cached_length(prompts[0]) >= cached_before
        assert eng.blocks.cached_length(prompts[0]) > 0 or len(prompts[0]) <= 16
    finally:
        eng.stop()


class FlakyRunner:
    """Wraps the real runner; a step that computes the start of a prompt beginning with 999 raises."""

    def __init__(self, inner):  # type: ignore[no-untyped-def]
        self._inner = inner

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self._inner, name)

    def execute(self, work, fed=None):  # type: ignore[no-untyped-def]
        if any(item.start == 0 and item.tokens[0] == 999 for item in work):
            raise RuntimeError("out of memory in prefill")
        return self._inner.execute(work, fed)


def test_a_failed_prefill_fails_only_the_requests_it_prefilled(loaded):
    eng = make_engine(loaded, prefill_budget_tokens=8)  # one prompt per prefill
    eng._runner = FlakyRunner(eng._runner)  # type: ignore[assignment]
    steady = [5, 6, 7, 8]

    async def run() -> tuple[list, list]:
        decoding = asyncio.Event()

        async def steady_stream() -> list:
            events = []
            async for event in eng.submit(request("steady", steady)):
                events.append(event)
                if isinstance(event, ContentDelta):
                    decoding.set()  # the steady request is decoding: now a bad prefill arrives
            return events

        task = asyncio.create_task(steady_stream())
        await decoding.wait()
        bad = [event async for event in eng.submit(request("bad", [999, 3, 4]))]
        return await task, bad

    try:
        events, bad = asyncio.run(asyncio.wait_for(run(), timeout=120))
    finally:
        eng.stop()
    assert isinstance(bad[-1], Failed) and bad[-1].message == "generation failed: RuntimeError"
    finished = [e for e in events if isinstance(e, Finished)]
    assert (
        ids(events) == greedy(loaded, steady, STEPS) and finished and finished[0].completion_tokens == STEPS
    )


def test_pushed_events_are_the_iterated_ones_and_a_failing_handler_ends_its_request_only(loaded):
    """``RequestStream.pushed`` (how ``GenerateStreams`` reads a request): each step's events go to
    the handler, the same events iterating gives; a handler that raises ends its own request, and
    its caller gets the error."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(2, 30))] for _ in range(3)]
    eng = make_engine(loaded, prefill_budget_tokens=512, max_running=8)

    async def iterated(name: str, prompt: list[int]) -> list:
        return [event async for event in eng.submit(request(name, prompt))]

    async def pushed(name: str, prompt: list[int], fail_after: int | None = None) -> list:
        events: list = []
        long = SamplingOptions(temperature=0.0, max_tokens=LONG, min_tokens=LONG)  # outlasts the abort

        def handler(batch: list) -> None:
            assert not events or fail_after is None or len(ids(events)) < fail_after, "called after it raised"
            events.extend(batch)
            if fail_after is not None and len(ids(events)) >= fail_after:
                raise ValueError("the caller's sink failed")

        work = (
            request(name, prompt)
            if fail_after is None
            else GenerationRequest(name, tuple(prompt), long, 0.0, return_token_ids=True)
        )
        await eng.submit(work).pushed(handler)
        return events

    async def run_all() -> tuple[list, list, BaseException | list]:
        reference = await asyncio.gather(*[iterated(f"i{i}", p) for i, p in enumerate(prompts)])
        got = await asyncio.gather(
            *[pushed(f"p{i}", p) for i, p in enumerate(prompts)],
            pushed("failing", prompts[0], fail_after=3),
            return_exceptions=True,
        )
        return reference, got[:-1], got[-1]

    try:
        reference, got, failing = asyncio.run(asyncio.wait_for(run_all(), timeout=120))
        for prompt, ref, events in zip(prompts, reference, got, strict=True):
            assert ids(events) == ids(ref) == greedy(loaded, prompt, STEPS)
            assert [type(e) for e in events if not isinstance(e, ContentDelta)] == [
                type(e) for e in ref if not isinstance(e, ContentDelta)
            ]
            assert isinstance(events[-1], Usage) and events[-1].completion_tokens == STEPS
        assert isinstance(failing, ValueError) and str(failing) == "the caller's sink failed"
        deadline = time.monotonic() + 10
        while eng.stats().running_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = eng.stats()
        assert stats.running_requests == 0 and stats.live_caches == 0
        assert stats.counters.requests_cancelled == 1 and stats.counters.requests_finished == 6
    finally:
        eng.stop()
