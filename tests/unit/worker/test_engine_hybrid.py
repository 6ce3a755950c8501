"""The engine on a tiny random hybrid model (Qwen3.5 text: Gated DeltaNet and attention layers)
loaded like a real checkpoint: greedy choices equal transformers' ``generate`` with chunked
prompts, ``n > 1`` (the second choice resumes from the prompt's state checkpoint), preemption (the
state rebuilt from position 0), a resumed stream, and a repeated prompt (resumed from the
checkpoint at its last block boundary: ``cached_tokens`` says so, and the logprobs equal)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from tests.unit.worker.test_engine import collect, greedy, request, token_ids
from worker.engine import state_slots
from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.server import eos_token_ids
from worker.types import ContentDelta, Failed, Usage

pytestmark = pytest.mark.slow  # left out of make test-fast


@pytest.fixture(scope="module")
def loaded(tiny_hybrid_dir):
    return load_model(str(tiny_hybrid_dir), device="cpu", dtype="float32")


def make_engine(loaded, *, pool_tokens: int = 4096, block_size: int = 16, max_running: int = 4) -> Engine:
    """A started engine with prefix caching asked for, chunks of 16 prompt tokens."""
    eng = Engine(
        ModelRunner(
            loaded, num_blocks=pool_tokens // block_size, block_size=block_size, max_sequences=max_running
        ),
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        options=EngineOptions(
            max_running=max_running, max_queue=100, prefill_budget_tokens=16, prefix_caching=True
        ),
    )
    eng.start()
    return eng


def logprobs(events: list, choice: int = 0) -> list[float]:
    """The logprobs of a choice's drawn tokens (a state off by anything shows here first)."""
    return [
        entry.logprob
        for e in events
        if isinstance(e, ContentDelta) and e.choice_index == choice
        for entry in e.logprobs
    ]


def run_all(engine: Engine, requests: list) -> list[list]:
    async def together() -> list[list]:
        return list(await asyncio.gather(*(collect(engine, r) for r in requests)))

    return asyncio.run(together())


def test_chunked_prompts_n_choices_and_a_repeated_prompt_resumed_at_a_checkpoint_equal_generate(
    loaded, monkeypatch
):
    """The 41-token prompt runs in chunks of 16; the second ends at its last block boundary (32),
    where its state is kept: the second choice and the repeated prompt resume there."""
    resumed: list[int] = []
    of = state_slots.Checkpoints.of

    def spy(self: state_slots.Checkpoints, entry: int) -> int:
        resumed.append(entry)
        return of(self, entry)

    monkeypatch.setattr(state_slots.Checkpoints, "of", spy)
    eng = make_engine(loaded)
    first, second = list(range(100, 141)), list(range(300, 323))
    try:
        events = run_all(
            eng,
            [
                request(first, temperature=0.0, max_tokens=8, min_tokens=8, n=2, logprobs=0),
                request(second, temperature=0.0, max_tokens=8, min_tokens=8),
            ],
        )
        again = run_all(eng, [request(first, temperature=0.0, max_tokens=8, min_tokens=8, logprobs=0)])[0]
        stats = eng.stats()
    finally:
        eng.stop()
    expected = greedy(loaded, first, 8)
    assert [token_ids(events[0], i) for i in range(2)] == [expected, expected]
    assert token_ids(events[1]) == greedy(loaded, second, 8)
    assert token_ids(again) == expected
    want = logprobs(events[0])
    assert logprobs(events[0], 1) == pytest.approx(want, abs=1e-4)
    assert logprobs(again) == pytest.approx(want, abs=1e-4)
    usage = next(e for e in again if isinstance(e, Usage))
    assert usage.cached_tokens == 32 and stats.counters.prefix_cache_hit_tokens == 32
    assert len(resumed) == 2 and resumed[0] == resumed[1]  # the second choice, the repeated prompt
    assert stats.state_cache_bytes > 0 and eng._scheduler.states.free == 4


def test_preempted_sequences_rebuild_their_state(loaded):
    """Four requests of up to 44 tokens on a pool of 96: the newer ones are sent back and start
    again from position 0, in whatever slot is free."""
    eng = make_engine(loaded, pool_tokens=96, block_size=8)
    prompts = [list(range(200 + 40 * i, 224 + 40 * i)) for i in range(4)]
    try:
        events = run_all(eng, [request(p, temperature=0.0, max_tokens=20, min_tokens=20) for p in prompts])
        stats = eng.stats()
    finally:
        eng.stop()
    assert stats.counters.preemptions > 0
    for prompt, got in zip(prompts, events, strict=True):
        assert token_ids(got) == greedy(loaded, prompt, 20)


def test_a_resumed_stream_rebuilds_the_state_of_its_delivered_tokens(loaded):
    prompt = list(range(400, 430))
    expected = greedy(loaded, prompt, 10)
    eng = make_engine(loaded)
    try:
        resumed = replace(
            request(prompt, temperature=0.0, max_tokens=10, min_tokens=10),
            resumed_token_ids=tuple(expected[:4]),
        )
        events = run_all(eng, [resumed])[0]
    finally:
        eng.stop()
    assert token_ids(events) == expected[4:]


class MidForwardFailure:
    """Wraps the runner: a step holding the start of a prompt beginning with 999 fails after the
    recurrent layers moved the step's decode rows' states (their rows run, then the step raises), as
    a failure in a later layer of the real forward would."""

    def __init__(self, inner: ModelRunner):
        self._inner = inner

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._inner, name)

    def execute(self, work, fed=None):  # type: ignore[no-untyped-def]
        if any(item.start == 0 and item.tokens[0] == 999 for item in work):
            decodes = [item for item in work if item.count == 1]
            if decodes:
                self._inner.execute(decodes, None)
            raise RuntimeError("out of memory in a later layer")
        return self._inner.execute(work, fed)


def test_a_failed_mixed_step_never_runs_a_hybrids_decode_rows_again(loaded) -> None:
    """An attention model's decode rows run again alone after a mixed step fails (their keys and
    values are rewritten in place); a hybrid's states moved already, so its rows fail with the step
    instead of going on from a state one token ahead: no stream ends with tokens other than
    ``generate``'s."""
    eng = make_engine(loaded)
    eng._runner = MidForwardFailure(eng._runner)  # type: ignore[assignment]
    steady = [5, 6, 7, 8]

    async def run() -> tuple[list, list]:
        decoding = asyncio.Event()

        async def steady_stream() -> list:
            events = []
            async for event in eng.submit(request(steady, temperature=0.0, max_tokens=12, min_tokens=12)):
                events.append(event)
                if isinstance(event, ContentDelta):
                    decoding.set()
            return events

        task = asyncio.create_task(steady_stream())
        await decoding.wait()
        bad = [event async for event in eng.submit(request([999, 3, 4], temperature=0.0, max_tokens=4))]
        return await task, bad

    try:
        events, bad = asyncio.run(asyncio.wait_for(run(), timeout=120))
    finally:
        eng.stop()
    assert isinstance(bad[-1], Failed)
    assert isinstance(events[-1], Failed), "the steady stream went on from a moved state"
    assert token_ids(events) == greedy(loaded, steady, 12)[: len(token_ids(events))]
