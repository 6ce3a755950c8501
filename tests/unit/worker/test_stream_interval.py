"""``--stream-interval``: a stream's tokens of that many engine steps travel together; its first
token, its end and anything else go at once; a preempted request's kept tokens go before it waits
(the fake runner, the engine driven one step at a time)."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.worker.test_engine_preemption import engine_on, preempt_the_newer, request, step
from worker.config import parse_config
from worker.engine.core import Engine
from worker.model.fake_runner import FakeRunner, load_fake_model
from worker.types import Dequeued, NewToken


@pytest.fixture(scope="module")
def fake(tiny_model_dir):
    return load_fake_model(str(tiny_model_dir))


def delivered(engine: Engine, max_tokens: int) -> list[list]:
    """What one request's stream was handed after each step (``[]`` for a step that handed it
    nothing), until the request ended."""

    async def scenario() -> list[list]:
        stream = engine.submit(request(list(range(10, 18)), max_tokens=max_tokens, ignore_eos=True))
        await asyncio.sleep(0)
        stream._queue.get_nowait()  # "queued", put by submit itself
        per_step = []
        while engine._scheduler.waiting or engine._scheduler.running:
            step(engine)
            await asyncio.sleep(0)
            batch = []
            while not stream._queue.empty():
                batch += stream._queue.get_nowait()
            per_step.append(batch)
        return per_step

    return asyncio.run(scenario())


def tokens(per_step: list[list]) -> list[NewToken]:
    return [item for batch in per_step for item in batch if isinstance(item, NewToken)]


def test_tokens_travel_every_interval_steps_and_the_first_and_last_at_once(fake):
    plain = delivered(engine_on(FakeRunner(fake, num_blocks=64, block_size=4), fake), 11)
    paced = delivered(engine_on(FakeRunner(fake, num_blocks=64, block_size=4), fake, stream_interval=3), 11)
    assert len(paced) == len(plain) == 11  # one token per step either way
    assert [len(tokens([batch])) for batch in plain] == [1] * 11
    # Step 1: admitted and the first token; then every third step three tokens; the end at once.
    assert [len(tokens([batch])) for batch in paced] == [1, 0, 0, 3, 0, 0, 3, 0, 0, 3, 1]
    assert any(isinstance(item, Dequeued) for item in paced[0])
    assert paced[-1][-1].finish is not None
    assert [t.token_id for t in tokens(paced)] == [t.token_id for t in tokens(plain)]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_preempted_request_hands_over_its_kept_tokens_before_it_waits(fake, overlap):
    """With overlapping steps, also the token its last draw brings once it is back in the queue."""

    async def scenario() -> None:
        engine = engine_on(
            FakeRunner(fake, num_blocks=6, block_size=4), fake, stream_interval=8, overlap=overlap
        )
        old, new = preempt_the_newer(engine)
        waiting = engine._scheduler.waiting[0]
        assert waiting.key == new.key and waiting.pacing.held == []
        await asyncio.sleep(0)
        handed = []
        while not new._queue.empty():
            handed += new._queue.get_nowait()
        drawn = waiting.choices[0].seq.generated
        assert drawn > 1 and len([item for item in handed if isinstance(item, NewToken)]) == drawn
        while engine._scheduler.waiting or engine._scheduler.running:
            step(engine)
        assert engine.counters.requests_finished == 2 and old.key != new.key

    asyncio.run(scenario())


def test_the_setting_is_checked(fake, capsys):
    assert parse_config(["--stream-interval", "4"], environ={}).stream_interval == 4
    assert parse_config([], environ={}).stream_interval == 1
    with pytest.raises(SystemExit):
        parse_config(["--stream-interval", "0"], environ={})
    assert "--stream-interval" in capsys.readouterr().err
    with pytest.raises(ValueError, match="stream_interval"):
        engine_on(FakeRunner(fake, num_blocks=8, block_size=4), fake, stream_interval=0)
