"""The engine's step loop under preemption, driven one step at a time on a tiny pool (fake runner and
the tiny model, in-process): stops reach preempted requests, progress bookkeeping empties, every
admission reports its cached prompt tokens, and a request whose admission raised ends even when the
rest of the step's planning raises."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

import pytest

from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.engine.request_stream import RequestStream
from worker.model.fake_runner import FakeRunner, load_fake_model
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.server import eos_token_ids
from worker.types import Failed, GenerationRequest, SamplingOptions, Usage


@pytest.fixture(scope="module")
def fake(tiny_model_dir):
    return load_fake_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


def engine_on(runner, loaded, **options) -> Engine:
    """An engine whose loop the test drives (:func:`step`): its thread is never started."""
    settings = {"max_running": 4, "max_queue": 100, "prefill_budget_tokens": 100, **options}
    return Engine(
        runner,
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        options=EngineOptions(**settings),
    )


def request(prompt: list[int], **sampling) -> GenerationRequest:
    return GenerationRequest(
        f"r{random.random()}", tuple(prompt), SamplingOptions(**sampling), time.monotonic()
    )


def step(engine: Engine):
    """One pass of the engine loop: control, plan, step. Returns the plan."""
    scheduled = engine._next_plan()
    assert scheduled is not None
    plan, _ = scheduled
    if not plan.empty:
        engine._step(plan)
    return plan


async def drain(stream) -> list:
    """The events the stream has received so far (its queue, processed as a consumer would)."""
    await asyncio.sleep(0)
    events: list = []
    while not stream._queue.empty():
        events += stream._process(stream._queue.get_nowait())
    return events


def preempt_the_newer(engine: Engine) -> tuple[RequestStream, RequestStream]:
    """Two requests on a 6-block pool of 4-token blocks, stepped until the older one's growth sends
    the newer one back to the queue (call on the event loop)."""
    old = engine.submit(request(list(range(10, 18)), max_tokens=12, ignore_eos=True))
    new = engine.submit(request(list(range(30, 38)), max_tokens=12, ignore_eos=True))
    for _ in range(12):
        step(engine)
        if engine._scheduler.waiting:
            break
    return old, new


def test_a_stop_found_while_preempted_ends_the_request_and_frees_its_blocks(fake):
    async def scenario() -> None:
        engine = engine_on(FakeRunner(fake, num_blocks=6, block_size=4), fake)
        old, new = preempt_the_newer(engine)
        assert [s.key for s in engine._scheduler.waiting] == [new.key]
        engine.stop_choices(new.key, [0])  # its output processor found a stop string meanwhile
        step(engine)
        assert not any(s.key == new.key for s in (*engine._scheduler.waiting, *engine._scheduler.running))
        assert engine.counters.requests_finished == 1
        while engine._scheduler.running:
            step(engine)
        await drain(old)
        assert engine.blocks.used == 0 and engine.counters.requests_finished == 2

    asyncio.run(scenario())


def test_progress_bookkeeping_is_empty_once_everything_finished_under_preemption(fake):
    async def scenario() -> None:
        # Same prompts admitted together: the newer request's copies of the shared blocks stay
        # unregistered, so when it is preempted they become free blocks, and it can be admitted again
        # in the same plan (it reattaches the older request's registered copies).
        engine = engine_on(FakeRunner(fake, num_blocks=8, block_size=4), fake)
        streams = [
            engine.submit(request(list(range(10, 18)), max_tokens=14, ignore_eos=True)) for _ in range(3)
        ]
        readmitted = 0
        for _ in range(400):
            if not (engine._scheduler.waiting or engine._scheduler.running):
                break
            plan = step(engine)
            readmitted += len({id(s) for s in plan.preempted} & {id(s) for s in plan.started})
            for stream in streams:
                await drain(stream)
        assert engine.counters.preemptions > 0 and readmitted > 0
        assert engine.counters.requests_finished == 3
        assert engine._ledger.progress_due == {}

    asyncio.run(scenario())


def usage_of(events: list) -> Usage:
    return next(e for e in events if isinstance(e, Usage))


def run_one(engine: Engine, req: GenerationRequest) -> list:
    async def scenario() -> list:
        stream = engine.submit(req)
        events: list = []
        for _ in range(200):
            if not (engine._scheduler.waiting or engine._scheduler.running):
                break
            step(engine)
            events += await drain(stream)
        return events + await drain(stream)

    return asyncio.run(scenario())


def test_resumed_and_scored_requests_report_their_cached_prompt_tokens(tiny):
    engine = engine_on(ModelRunner(tiny, num_blocks=64, block_size=16), tiny, prefix_caching=True)
    prompt = [random.Random(3).randrange(100, 1000) for _ in range(40)]
    plain = usage_of(run_one(engine, request(prompt, max_tokens=4)))
    assert plain.cached_tokens == 0
    hits = engine.counters.prefix_cache_hit_tokens
    again = usage_of(run_one(engine, request(prompt, max_tokens=4)))
    assert again.cached_tokens == 32  # two whole blocks of 16
    resumed = usage_of(run_one(engine, replace(request(prompt, max_tokens=6), resumed_token_ids=(5, 6))))
    scored = usage_of(run_one(engine, request(prompt, max_tokens=2, prompt_logprobs=1)))
    scored_only = usage_of(run_one(engine, request(prompt, max_tokens=0, prompt_logprobs=0)))
    assert (resumed.cached_tokens, scored.cached_tokens, scored_only.cached_tokens) == (32, 32, 32)
    assert engine.counters.prefix_cache_hit_tokens - hits == 4 * 32


def test_a_request_whose_admission_raised_ends_when_planning_then_raises(fake, monkeypatch):
    async def scenario() -> None:
        engine = engine_on(FakeRunner(fake, num_blocks=64, block_size=4), fake)
        decoding = engine.submit(request(list(range(10, 18)), max_tokens=12, ignore_eos=True))
        step(engine)
        doomed = engine.submit(request(list(range(30, 38)), max_tokens=4))
        scheduler = engine._scheduler
        admit = scheduler._start

        def admission_bug(state, budget, plan):  # type: ignore[no-untyped-def]
            if state.key == doomed.key:
                raise ValueError("admission bug")
            return admit(state, budget, plan)

        def proposer_bug(state, seq, room):  # type: ignore[no-untyped-def]
            raise RuntimeError("proposer bug")  # after the admissions: the plan is lost

        monkeypatch.setattr(scheduler, "_start", admission_bug)
        monkeypatch.setattr(scheduler, "propose", proposer_bug)
        passes = iter([engine._next_plan])
        monkeypatch.setattr(engine, "_next_plan", lambda: next(passes, lambda: None)())
        engine._loop()  # one pass (its planning raises), then the loop ends
        for stream in (decoding, doomed):
            events = await drain(stream)
            assert isinstance(events[-1], Failed) and events[-1].message == "generation failed: RuntimeError"
        assert engine.counters.requests_failed == 2 and engine.blocks.used == 0

    asyncio.run(scenario())
