"""``--stream-interval``: a stream's tokens of that many engine steps travel together; its first
token, its end and anything else go at once; a preempted request's kept tokens go before it waits
(the fake runner, the engine driven one step at a time). A request's own ``stream_interval_s``
(``stream_interval_ms`` on the wire) does the same by time, at the step nearest each window's end."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tests.unit.worker.test_engine_preemption import engine_on, preempt_the_newer, request, step
from worker.config import parse_config
from worker.engine import update as update_module
from worker.engine.core import Engine
from worker.engine.sink import Pacing, paced_by_time
from worker.model.fake_runner import FakeRunner, load_fake_model
from worker.types import Dequeued, FinishReason, NewToken, Progress


@pytest.fixture(scope="module")
def fake(tiny_model_dir):
    return load_fake_model(str(tiny_model_dir))


class Clock:
    """The engine's clock in a test: each step takes ``step_s``."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 1000.0, step_s

    def monotonic(self) -> float:
        return self.now


def delivered(
    engine: Engine, max_tokens: int, *, interval_s: float = 0.0, clock: Clock | None = None
) -> list[list]:
    """What one request's stream was handed after each step (``[]`` for a step that handed it
    nothing), until the request ended; ``interval_s``: the request's own stream interval, each
    step ``clock.step_s`` after the last."""

    async def scenario() -> list[list]:
        paced = dataclasses.replace(
            request(list(range(10, 18)), max_tokens=max_tokens, ignore_eos=True), stream_interval_s=interval_s
        )
        stream = engine.submit(paced)
        await asyncio.sleep(0)
        stream._queue.get_nowait()  # "queued", put by submit itself
        per_step = []
        while engine._scheduler.waiting or engine._scheduler.running:
            if clock is not None:
                clock.now += clock.step_s
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


@pytest.mark.parametrize(
    ("step_s", "expected"),
    [
        # The first token alone; then what the steps that end each window bring; the end at once.
        (0.010, [1, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2]),
        (0.005, [1, 0, 0, 0, 4, 0, 0, 0, 4, 0, 2]),
        (0.012, [1, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2]),
        (0.015, [1, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2]),  # 30 ms apart: 15 is too early
        (0.019, [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),  # within a quarter step: the window's end
        (0.030, [1] * 11),  # steps longer than the window: each goes at once
    ],
)
def test_a_requests_stream_interval_hands_tokens_over_about_once_per_window(
    fake, monkeypatch, step_s, expected
):
    clock = Clock(step_s)
    monkeypatch.setattr(update_module, "time", clock)
    plain = delivered(engine_on(FakeRunner(fake, num_blocks=64, block_size=4), fake), 11)
    paced = delivered(
        engine_on(FakeRunner(fake, num_blocks=64, block_size=4), fake), 11, interval_s=0.02, clock=clock
    )
    assert [len(tokens([batch])) for batch in paced] == expected
    assert any(isinstance(item, Dequeued) for item in paced[0])
    assert paced[-1][-1].finish is not None
    assert [t.token_id for t in tokens(paced)] == [t.token_id for t in tokens(plain)]


def test_progress_and_ends_are_never_kept_back_by_time() -> None:
    pacing = Pacing()

    def token(finish: FinishReason | None = None) -> NewToken:
        return NewToken(0, 7, 0.0, finish=finish)

    assert paced_by_time(pacing, [token()], 0.02, 1.000) == [token()]  # the first token
    assert paced_by_time(pacing, [token()], 0.02, 1.001) is None
    progress = Progress("queued", 0.0)
    assert paced_by_time(pacing, [progress], 0.02, 1.002) == [token(), progress]  # with what was kept
    assert paced_by_time(pacing, [token()], 0.02, 1.003) is None
    ended = token(FinishReason.STOP)
    assert paced_by_time(pacing, [ended], 0.02, 1.004) == [token(), ended]
    assert pacing.held == []


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
