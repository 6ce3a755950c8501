"""Faults inside the engine's step loop, injected on a tiny random Llama: a proposer, a step, the
scheduler, the block accounting, the device and the loop itself. Each fails at most the requests it
belongs to, or stops the engine with every stream ended; no stream is ever left open."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from tests.unit.worker.test_engine import greedy, make_engine
from tests.unit.worker.test_speculation import engine as speculating_engine
from worker.engine import sink
from worker.engine.core import Engine
from worker.engine.failures import DeviceFailure, EngineFailure
from worker.engine.speculation import RowSpeculation, Speculation
from worker.errors import NotReady
from worker.model.loader import load_model
from worker.sampling.sampler import SequenceSampling
from worker.types import ContentDelta, Failed, GenerationRequest, SamplingOptions, Usage

STEPS = 8
LONG = 96  # tokens of the requests a fault meets while they run
HANG_S = 120  # a stream not ended by then hangs (a deadlock detector, not a timing bound)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


def request(name: str, prompt: list[int], **sampling: Any) -> GenerationRequest:
    options = SamplingOptions(**{"temperature": 0.0, "max_tokens": STEPS, "min_tokens": STEPS, **sampling})
    return GenerationRequest(name, tuple(prompt), options, time.monotonic(), return_token_ids=True)


def ids(events: list) -> list[int]:
    return [t for e in events if isinstance(e, ContentDelta) for t in e.token_ids]


def finished(events: list) -> bool:
    return bool(events) and isinstance(events[-1], Usage) and events[-1].completion_tokens == STEPS


def failed(events: list) -> str | None:
    return events[-1].message if events and isinstance(events[-1], Failed) else None


async def stream(eng: Engine, req: GenerationRequest, first_token: asyncio.Event | None = None) -> list:
    events = []
    async for event in eng.submit(req):
        events.append(event)
        if first_token is not None and isinstance(event, ContentDelta):
            first_token.set()
    return events


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, HANG_S))


# ------------------------------------------------------------------ speculation


class RaisingProposer(Speculation):
    """n-gram proposals, except for rows whose prompt starts with 999: their proposer raises (as a
    draft's forward out of memory would)."""

    def guesses(
        self, sampling: SequenceSampling, acceptance: RowSpeculation, tokens: Sequence[int], k: int
    ) -> list[int]:
        if tokens[0] == 999:
            raise RuntimeError("draft out of memory")
        return super().guesses(sampling, acceptance, tokens, k)


def test_a_proposer_that_raises_for_one_row_costs_that_row_its_proposals_only(loaded) -> None:
    eng = speculating_engine(loaded, speculation=RaisingProposer(tokens=3, min_n=1, max_n=2))
    prompts = {"bad": [999, 5, 6, 5, 6, 5], "good": [7, 8, 7, 8, 7], "plain": [9, 10, 11]}

    async def all_of() -> list[list]:
        return await asyncio.gather(
            stream(eng, request("bad", prompts["bad"])),
            stream(eng, request("good", prompts["good"])),
            stream(eng, request("plain", prompts["plain"], speculative=False)),
        )

    try:
        results = run(all_of())
        counters = eng.stats().counters
    finally:
        eng.stop()
    for (name, prompt), events in zip(prompts.items(), results, strict=True):
        assert finished(events), (name, events[-1])
        assert ids(events) == greedy(loaded, prompt, STEPS), name
    assert counters.requests_failed == 0
    assert counters.speculative_proposal_failures >= STEPS - 2  # every step of the bad row after its first
    assert counters.speculative_proposed_tokens > 0  # the good row still proposed


class BlockingDraft:
    """A draft model whose forward waits until the test saw the engine's lock free (or gives up)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released_in_time: list[bool] = []

    def propose(self, cache: Any, tokens: Sequence[int], k: int) -> list[int]:
        self.entered.set()
        self.released_in_time.append(self.release.wait(30))
        return []


def test_a_draft_forward_runs_without_the_engine_lock(loaded) -> None:
    draft = BlockingDraft()
    eng = speculating_engine(loaded, speculation=Speculation(tokens=3, min_n=1, max_n=2, draft=draft))  # type: ignore[arg-type]

    def watcher() -> None:
        draft.entered.wait(HANG_S)
        eng.stats()  # takes the lock: blocks while a draft forward holds it
        eng.abort("nobody")  # what the event loop does when a caller goes away
        draft.release.set()

    thread = threading.Thread(target=watcher)
    thread.start()
    try:
        events = run(stream(eng, request("r", [5, 6, 7])))
    finally:
        draft.release.set()
        thread.join()
        eng.stop()
    assert finished(events)
    assert draft.released_in_time and all(draft.released_in_time)


# ------------------------------------------------------------------ a step, the scheduler, the loop


class Fault:
    """A fault raised ``times`` times once ``engine`` runs ``rows`` decoding requests (checked on the
    engine thread, so the fault meets them mid-stream however fast the model is)."""

    def __init__(self, error: BaseException | None, times: int = 1):
        self.error, self.times, self.raised = error, times, 0
        self.engine: Engine | None = None
        self.rows = 0

    def due(self) -> bool:
        if self.engine is None or self.raised >= self.times:
            return False
        if self.raised:  # fired once: it goes on firing until ``times``
            return True
        running = self.engine._scheduler.running
        return len(running) >= self.rows and all(c.seq.generated > 0 for s in running for c in s.choices)

    def maybe(self) -> None:
        if self.due():
            self.raised += 1
            if self.error is not None:
                raise self.error

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.maybe()
            return function(*args, **kwargs)

        return wrapped


def inject(eng: Engine, where: str, fault: Fault, monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes ``where`` raise ``fault`` once it is due."""
    if where == "ready":  # the fence of a step's draw
        monkeypatch.setattr(eng._runner, "ready", fault.wrap(eng._runner.ready))
    elif where == "commit":  # the KV commit after a forward (a reference-count bug raises here)
        monkeypatch.setattr(eng._scheduler, "committed", fault.wrap(eng._scheduler.committed))
    elif where == "deliver":  # handing a step's outputs over (a pipe write under --engine-process)
        monkeypatch.setattr(sink, "deliver", fault.wrap(sink.deliver))
    elif where == "schedule":  # a scheduler bug
        monkeypatch.setattr(eng._scheduler, "schedule", fault.wrap(eng._scheduler.schedule))
    elif where == "forward":
        monkeypatch.setattr(eng._runner, "execute", fault.wrap(eng._runner.execute))
    else:
        raise AssertionError(where)


def run_with_fault(eng: Engine, fault: Fault, running: int, queued: int) -> list[list]:
    """``running`` requests that run and ``queued`` more that wait behind them (``max_running`` is
    ``running``); ``fault`` becomes due once every running one decodes. Returns each request's
    events (every stream must end)."""
    fault.engine, fault.rows = eng, running
    long = {"max_tokens": LONG, "min_tokens": LONG}
    requests = [request(f"run{i}", [5 + i, 6, 7, 8], **long) for i in range(running)]
    requests += [request(f"wait{i}", [40 + i, 6]) for i in range(queued)]

    async def all_of() -> list[list]:
        return list(await asyncio.gather(*(stream(eng, r) for r in requests)))

    return list(run(all_of()))


@pytest.mark.parametrize(
    ("where", "error"),
    [
        ("ready", ValueError("fence bug")),
        ("commit", RuntimeError("block 3 released more often than it was taken")),
        ("deliver", BrokenPipeError("pipe")),
        ("schedule", KeyError("scheduler bug")),
    ],
)
def test_a_step_that_raises_fails_its_requests_and_the_loop_goes_on(
    loaded, monkeypatch, where, error
) -> None:
    eng = make_engine(loaded, prefill_budget_tokens=64, max_running=2, prefix_caching=True)
    fault = Fault(error)
    inject(eng, where, fault, monkeypatch)
    try:
        results = run_with_fault(eng, fault, running=2, queued=0)
        after = run(stream(eng, request("after", [3, 4, 5])))
        stats = eng.stats()
    finally:
        eng.stop()
    assert fault.raised == 1
    assert all(failed(events) == f"generation failed: {type(error).__name__}" for events in results)
    assert finished(after) and ids(after) == greedy(loaded, [3, 4, 5], STEPS)
    assert eng.failure is None
    assert stats.counters.step_failures == 1 and stats.counters.requests_failed == 2
    assert stats.kv_blocks_used == 0


def test_a_failure_that_leaves_the_block_accounting_wrong_stops_the_engine(loaded, monkeypatch) -> None:
    stopped: list[BaseException] = []
    eng = make_engine(loaded, prefill_budget_tokens=64, max_running=2)
    eng._failures.on_engine_failure = stopped.append
    blocks = eng.blocks
    commit = blocks.commit
    fault = Fault(None)

    def corrupting_commit(seq: Any, tokens: Any, computed: int) -> None:
        if fault.due():
            fault.raised += 1
            blocks._refs[seq.table[0]] += 1  # a block taken twice, then the bug surfaces
            raise RuntimeError("reference-count bug")
        commit(seq, tokens, computed)

    monkeypatch.setattr(blocks, "commit", corrupting_commit)
    try:
        results = run_with_fault(eng, fault, running=2, queued=2)

        async def late() -> None:
            eng.submit(request("late", [1, 2]))

        with pytest.raises(NotReady, match="its engine failed"):
            run(late())
    finally:
        eng.stop()
    # The step's requests fail with its error; then the engine stops and the queued ones hear why.
    assert [failed(events) for events in results] == 2 * ["generation failed: RuntimeError"] + 2 * [
        "generation failed: the worker's engine failed"
    ]
    assert isinstance(eng.failure, EngineFailure) and "accounting is wrong: block" in str(eng.failure)
    assert stopped == [eng.failure]


# ------------------------------------------------------------------ every exit of the loop


@pytest.mark.parametrize("exit_path", ["stop", "device", "unrecoverable", "loop bug"])
def test_every_exit_of_the_loop_ends_every_stream(loaded, monkeypatch, exit_path) -> None:
    """Running and queued requests alike hear their end, whichever way the loop ends."""
    eng = make_engine(loaded, prefill_budget_tokens=64, max_running=2)
    stopped: list[BaseException] = []
    eng._failures.on_engine_failure = stopped.append
    if exit_path == "stop":  # stopped from another thread, as a drained worker stops it
        fault = Fault(None)
        inject(eng, "ready", fault, monkeypatch)

        def stop_once() -> None:
            if fault.due():
                fault.raised += 1
                threading.Thread(target=eng.stop).start()

        monkeypatch.setattr(fault, "maybe", stop_once)
    elif exit_path == "device":
        fault = Fault(RuntimeError("CUDA error: unspecified launch failure"))
        inject(eng, "forward", fault, monkeypatch)
    elif exit_path == "unrecoverable":  # failing the step's requests fails again
        fault = Fault(BrokenPipeError("pipe"), times=2)
        inject(eng, "deliver", fault, monkeypatch)
    else:  # the failure handling itself has a bug
        fault = Fault(ValueError("step bug"))
        inject(eng, "ready", fault, monkeypatch)
        monkeypatch.setattr(eng._failures, "contain", lambda *_: 1 / 0)
    try:
        results = run_with_fault(eng, fault, running=2, queued=2)
    finally:
        eng.stop()
    assert len(results) == 4 and all(failed(events) for events in results), [r[-1] for r in results]
    if exit_path == "stop":
        assert eng.failure is None and not stopped
    else:
        assert stopped == [eng.failure] and isinstance(eng.failure, EngineFailure)
        assert isinstance(eng.failure, DeviceFailure) == (exit_path == "device")


def test_the_owner_hears_the_engine_stop_before_any_request_hears_it(loaded, monkeypatch) -> None:
    """The owner (the worker's health) is told before the last outputs go to the streams: a caller
    that hears its request failed must not find the worker still serving when it asks."""
    eng = make_engine(loaded, prefill_budget_tokens=64, max_running=2)
    order: list[str] = []
    eng._failures.on_engine_failure = lambda failure: order.append("owner")
    deliver = sink.deliver

    def recording(batches: Any) -> None:
        batches = list(batches)
        if any(type(o).__name__ == "CoreFailure" for _, outputs in batches for o in outputs):
            order.append("requests")
        deliver(batches)

    monkeypatch.setattr(sink, "deliver", recording)
    fault = Fault(RuntimeError("CUDA error: unspecified launch failure"))
    inject(eng, "forward", fault, monkeypatch)
    try:
        run_with_fault(eng, fault, running=2, queued=2)
    finally:
        eng.stop()
    assert order[:2] == ["owner", "requests"]
