"""The stats the engine publishes for ``/metrics`` (worker/engine/stats.py ``PublishedStats``): a
scrape reads the last copy and never waits for the engine's lock; the engine publishes a copy before
it hands out a request's end and whenever it runs out of work, so a scrape after a stream's end
counts it; in the engine process, the copy that counts an end never reaches the serving process
after the end. The engine runs the fake runner (no model); most tests drive its loop by hand."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from worker.engine import process
from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.engine.process_messages import Outputs, StatsReport
from worker.engine.stats import EngineCounters, EngineStats
from worker.model.fake_runner import FakeRunner, load_fake_model
from worker.server import eos_token_ids, metrics_text
from worker.types import ChoiceEnded, ContentDelta, CoreOutput, GenerationRequest, NewToken, SamplingOptions

# Long enough that no copy is taken because one is due: each copy a test sees has another cause.
NEVER_DUE_S = 3600.0


@pytest.fixture(scope="module")
def fake(tiny_model_dir):  # type: ignore[no-untyped-def]
    return load_fake_model(str(tiny_model_dir))


def engine_on(fake: Any) -> Engine:
    """An engine on the fake runner whose stats are never due (its thread is not started)."""
    engine = Engine(
        FakeRunner(fake, num_blocks=64, block_size=16),
        fake.tokenizer,
        eos_token_ids=eos_token_ids(fake.model, fake.tokenizer),
        context_length=fake.context_length,
        options=EngineOptions(max_running=4, max_queue=100, prefill_budget_tokens=100),
    )
    engine.published.interval_s = NEVER_DUE_S
    return engine


def request(name: str, max_tokens: int = 3, **more: Any) -> GenerationRequest:
    options = SamplingOptions(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    return GenerationRequest(name, (1, 2, 3, 4), options, time.monotonic(), **more)


class RecordingLoop:
    """Stands in for a stream's event loop: keeps every output handed over."""

    def __init__(self) -> None:
        self.outputs: list[CoreOutput] = []

    def call_soon_threadsafe(self, _: Callable[..., Any], items: list[tuple[Any, list[CoreOutput]]]) -> None:
        for _sink, outputs in items:
            self.outputs += outputs


def ends(outputs: list[CoreOutput]) -> bool:
    return any(isinstance(o, ChoiceEnded) or (isinstance(o, NewToken) and o.finish) for o in outputs)


def step_until_the_end(engine: Engine, ended: Callable[[], bool]) -> None:
    """Runs the engine's loop by hand, one pass at a time, until ``ended()``; stops right after the
    step that ended the request (before the loop would go idle)."""
    for _ in range(50):
        scheduled = engine._next_plan()
        assert scheduled is not None
        plan, _ = scheduled
        if not plan.empty:
            engine._step(plan)
        if ended():
            return
    raise AssertionError("the request never ended")


def test_a_scrape_never_waits_for_the_engines_lock(fake: Any) -> None:
    """``/metrics`` while the step loop holds the engine's lock (as it does to plan, or while a
    draft model proposes): it answers from the published copy."""
    engine = engine_on(fake)
    serving = SimpleNamespace(engine=engine, loaded=SimpleNamespace(model_id="m"))
    config = SimpleNamespace(metrics_names="sluice", fake_tokens=True)
    answered = threading.Event()
    texts: list[str | None] = []

    def scrape() -> None:
        texts.append(metrics_text(serving, config))  # type: ignore[arg-type]
        answered.set()

    with engine._cv:  # the step loop's lock, held
        threading.Thread(target=scrape, daemon=True).start()
        assert answered.wait(30), "the scrape waited for the engine's lock"
    assert texts[0] is not None and "sluice_worker_queue_depth" in texts[0]


def test_a_request_ends_after_the_copy_that_counts_it(fake: Any) -> None:
    engine = engine_on(fake)
    loop = RecordingLoop()
    sink = SimpleNamespace(key="a", loop=loop, put=None)
    engine.enqueue(engine.prepare(request("a")), "a", sink)  # type: ignore[arg-type]
    step_until_the_end(engine, lambda: ends(loop.outputs))
    stats = engine.latest_stats()
    assert stats.counters.requests_finished == 1 and stats.running_requests == 0
    assert stats.counters.generated_tokens == 3


def test_in_the_engine_process_the_copy_that_counts_an_end_comes_no_later_than_the_end(fake: Any) -> None:
    """Whether the step's outputs carry the copy or the outbox's thread sent it first."""
    engine = engine_on(fake)
    ours, theirs = multiprocessing.Pipe()
    outbox = process._StatsOutbox(process._Sender(ours))
    engine.published.listen(outbox.offer)
    loop = process._PipeLoop(outbox)
    prepared = engine.prepare(request("a"))
    engine.enqueue(prepared, "a", process._RemoteSink("a", loop))  # type: ignore[arg-type]
    seen: list[EngineStats] = []

    def ended() -> bool:
        while theirs.poll():
            message = theirs.recv()
            if isinstance(message, StatsReport):
                seen.append(message.stats)
            elif isinstance(message, Outputs):
                if message.stats is not None:
                    seen.append(message.stats)
                if any(ends(outputs) for _, outputs in message.batches):
                    return True
        return False

    step_until_the_end(engine, ended)
    assert seen and seen[-1].counters.requests_finished == 1
    assert seen[-1].counters.generated_tokens == 3


def test_an_idle_engine_publishes_what_changed(fake: Any) -> None:
    """A cancelled request, then one its resumed tokens ended before it was queued, are counted in
    the copy once the engine has nothing to do (none is ever due here)."""
    engine = engine_on(fake)
    engine.start()

    def published(check: Callable[[EngineCounters], bool]) -> None:
        deadline = time.monotonic() + 30
        while not check(engine.latest_stats().counters):
            assert time.monotonic() < deadline, engine.latest_stats()
            time.sleep(0.01)

    async def cancel_one() -> None:
        stream = engine.submit(request("long", max_tokens=400))
        async for event in stream:
            if isinstance(event, ContentDelta):
                break
        stream.cancel()  # the caller went away: the request is aborted

    async def end_one_before_it_is_queued() -> None:
        engine.submit(request("resumed", max_tokens=2, resumed_token_ids=(5, 6)))

    try:
        asyncio.run(cancel_one())
        published(lambda counters: counters.requests_cancelled == 1)
        assert engine.latest_stats().running_requests == 0
        asyncio.run(end_one_before_it_is_queued())
        published(lambda counters: counters.requests_finished == 1)
    finally:
        engine.stop()
