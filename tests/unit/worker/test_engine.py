"""The engine on a tiny random Llama loaded like a real checkpoint (in-process, no gRPC)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.sampling.grammar import GrammarCompiler
from worker.server import eos_token_ids
from worker.types import (
    ContentDelta,
    Finished,
    FinishReason,
    GenerationRequest,
    Progress,
    PromptLogprobs,
    SamplingOptions,
    Usage,
)

pytestmark = pytest.mark.slow  # left out of make test-fast


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


def make_engine(
    loaded,
    *,
    prefill_budget_tokens: int,
    prefix_caching: bool = False,
    pool_tokens: int = 4096,
    block_size: int = 16,
    max_running: int = 4,
    overlap: bool = False,
    grammars: GrammarCompiler | None = None,
) -> Engine:
    """A started engine on ``loaded`` with ``max_running`` sequence slots over a pool of
    ``pool_tokens``; the caller stops it."""
    eng = Engine(
        ModelRunner(loaded, num_blocks=pool_tokens // block_size, block_size=block_size),
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        options=EngineOptions(
            max_running=max_running,
            max_queue=1000,
            prefill_budget_tokens=prefill_budget_tokens,
            prefix_caching=prefix_caching,
            overlap=overlap,
        ),
        grammars=grammars,
    )
    eng.start()
    return eng


def greedy(loaded, prompt: list[int], steps: int) -> list[int]:
    """``steps`` tokens of transformers' own greedy ``generate`` on ``prompt`` alone."""
    with torch.inference_mode():
        return loaded.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
        )[0, len(prompt) :].tolist()


@pytest.fixture
def engine(loaded):
    eng = make_engine(loaded, prefill_budget_tokens=64)
    yield eng
    eng.stop()


def request(prompt: list[int], **sampling) -> GenerationRequest:
    return GenerationRequest(
        f"r{random.random()}",
        tuple(prompt),
        SamplingOptions(**sampling),
        time.monotonic(),
        return_token_ids=True,
    )


async def collect(engine: Engine, req: GenerationRequest) -> list:
    return [event async for event in engine.submit(req)]


def token_ids(events: list, choice: int = 0) -> list[int]:
    return [
        t for e in events if isinstance(e, ContentDelta) and e.choice_index == choice for t in e.token_ids
    ]


def test_batched_greedy_equals_sequential_generate(engine, loaded):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(length)] for length in (3, 17, 40, 9, 25, 64)]
    steps = 12

    async def run_all():
        return await asyncio.gather(
            *[
                collect(engine, request(p, temperature=0.0, max_tokens=steps, min_tokens=steps))
                for p in prompts
            ]
        )

    results = asyncio.run(run_all())
    for prompt, events in zip(prompts, results, strict=True):
        expected = greedy(loaded, prompt, steps)
        # Tokens that decode to nothing visible still count; compare the full id stream.
        finished = [e for e in events if isinstance(e, Finished)]
        assert finished[0].completion_tokens == steps and finished[0].reason is FinishReason.LENGTH
        text = "".join(e.text for e in events if isinstance(e, ContentDelta))
        assert text == loaded.tokenizer.decode(expected, skip_special_tokens=True)


def test_event_order_and_usage(engine):
    events = asyncio.run(collect(engine, request([5, 6, 7], temperature=0.0, max_tokens=5, n=2)))
    finished = [e for e in events if isinstance(e, Finished)]
    assert sorted(f.choice_index for f in finished) == [0, 1]
    assert isinstance(events[-1], Usage)
    assert events[-1].prompt_tokens == 3 and events[-1].completion_tokens == sum(
        f.completion_tokens for f in finished
    )
    for f in finished:  # nothing of a choice after its finish
        later = events[events.index(f) + 1 :]
        assert not any(isinstance(e, ContentDelta) and e.choice_index == f.choice_index for e in later)
    assert token_ids(events, 0) == token_ids(events, 1)  # greedy choices agree


def test_stop_string_never_leaks(engine, loaded):
    base = asyncio.run(collect(engine, request([5, 6, 7], temperature=0.0, max_tokens=30, min_tokens=30)))
    text = "".join(e.text for e in base if isinstance(e, ContentDelta))
    stop = text[10:13]
    assert len(stop) == 3
    events = asyncio.run(collect(engine, request([5, 6, 7], temperature=0.0, max_tokens=30, stop=(stop,))))
    out = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert stop not in out and text.startswith(out)
    finished = next(e for e in events if isinstance(e, Finished))
    assert finished.reason is FinishReason.STOP and finished.matched_stop == stop


def test_seeded_sampling_is_reproducible_while_batched(engine):
    async def run():
        same = request([9, 8, 7], temperature=1.0, seed=1234, max_tokens=10, min_tokens=10)
        noise = [request([1, 2, 3, 4], temperature=1.0, max_tokens=10) for _ in range(3)]
        alone = await collect(engine, same)
        together = await asyncio.gather(collect(engine, same), *[collect(engine, r) for r in noise])
        return alone, together[0]

    alone, together = asyncio.run(run())
    assert token_ids(alone) == token_ids(together)


def test_random_cancellations_leave_nothing_behind(engine):
    rng = random.Random(42)

    async def one(i: int) -> None:
        stream = engine.submit(
            request(
                [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))], max_tokens=200, ignore_eos=True
            )
        )
        if rng.random() < 0.2:  # cancelled while queued, before any event
            stream.cancel()
            return
        seen = 0
        limit = rng.randrange(0, 6)
        async for _ in stream:
            seen += 1
            if seen >= limit:
                break  # leaving the loop closes the iterator, which aborts

    async def run_all():
        await asyncio.gather(*[one(i) for i in range(300)])
        for _ in range(100):  # aborts apply at the start of the next step
            stats = engine.stats()
            if not stats.running_requests and not stats.waiting_requests:
                return stats
            await asyncio.sleep(0.05)
        return engine.stats()

    stats = asyncio.run(run_all())
    assert stats.running_requests == 0 and stats.waiting_requests == 0
    assert stats.running_sequences == 0 and stats.live_caches == 0
    assert stats.counters.requests_cancelled + stats.counters.requests_finished == 300
    assert stats.counters.requests_cancelled > 250
    assert stats.cache_tokens == 0 and stats.reserved_tokens == 0 and stats.kv_blocks_used == 0


def test_prompt_logprobs_score_every_token_after_the_first(engine, loaded):
    prompt = [5, 17, 300, 42, 8, 99]
    req = request(prompt, temperature=0.0, max_tokens=0, prompt_logprobs=2)
    events = asyncio.run(collect(engine, req))
    scored = next(e for e in events if isinstance(e, PromptLogprobs))
    assert [lp.token_id for lp in scored.logprobs] == prompt[1:]
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    for position, entry in enumerate(scored.logprobs):
        assert abs(entry.logprob - float(expected[position, prompt[position + 1]])) < 1e-4
        assert len(entry.top) == 2 and entry.top[0].token_id == int(expected[position].argmax())
    finished = next(e for e in events if isinstance(e, Finished))
    assert finished.reason is FinishReason.LENGTH and finished.completion_tokens == 0
    assert isinstance(events[-1], Usage) and events[-1].completion_tokens == 0
    assert not any(isinstance(e, ContentDelta) for e in events)


def test_prompt_logprobs_then_generation_as_usual(engine, loaded):
    prompt = [9, 8, 7, 6]
    events = asyncio.run(collect(engine, request(prompt, temperature=0.0, max_tokens=5, prompt_logprobs=0)))
    scored = [e for e in events if isinstance(e, PromptLogprobs)]
    assert len(scored) == 1 and len(scored[0].logprobs) == 3
    assert token_ids(events) == greedy(loaded, prompt, 5)[: len(token_ids(events))]
    assert events.index(scored[0]) < min(i for i, e in enumerate(events) if isinstance(e, ContentDelta))


def test_greedy_equals_sequential_generate_under_chunking_preemption_and_prefix_hits(loaded):
    """A pool of 20 blocks of 8 tokens for 6 requests of up to 60 tokens each: prompts come in
    chunks of 16 tokens, the newest requests are preempted and recomputed, and prompts sharing a
    24-token start reuse its blocks. Every text still equals ``generate`` on the prompt alone."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 1000) for _ in range(24)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (3, 17, 9)]
    prompts += [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 30, 12)]
    steps = 20
    eng = make_engine(
        loaded, prefill_budget_tokens=16, prefix_caching=True, pool_tokens=160, block_size=8, max_running=6
    )

    async def run_all():
        first = await collect(eng, request(prompts[0], temperature=0.0, max_tokens=steps, min_tokens=steps))
        rest = await asyncio.gather(
            *[
                collect(eng, request(p, temperature=0.0, max_tokens=steps, min_tokens=steps))
                for p in prompts[1:]
            ]
        )
        return [first, *rest]

    try:
        results = asyncio.run(asyncio.wait_for(run_all(), timeout=300))
        stats = eng.stats()
    finally:
        eng.stop()
    for prompt, events in zip(prompts, results, strict=True):
        assert token_ids(events) == greedy(loaded, prompt, steps)
    assert stats.counters.preemptions > 0
    assert stats.counters.prefix_cache_hit_tokens >= 2 * 24
    assert stats.kv_blocks_used == 0 and stats.running_requests == 0


def test_n_choices_share_the_prompt_and_each_equals_generate(loaded):
    eng = make_engine(loaded, prefill_budget_tokens=64, prefix_caching=True, block_size=8)
    prompt = list(range(40, 61))
    try:
        events = asyncio.run(collect(eng, request(prompt, temperature=0.0, max_tokens=8, min_tokens=8, n=3)))
    finally:
        eng.stop()
    expected = greedy(loaded, prompt, 8)
    assert [token_ids(events, i) for i in range(3)] == [expected] * 3


def test_a_chunked_prompt_reports_its_progress_after_each_chunk(loaded):
    eng = make_engine(loaded, prefill_budget_tokens=16)
    try:
        events = asyncio.run(collect(eng, request(list(range(100, 150)), temperature=0.0, max_tokens=2)))
    finally:
        eng.stop()
    stages = [(e.stage, round(e.fraction, 2)) for e in events if isinstance(e, Progress)]
    # 50 prompt tokens in chunks of 16: 16, 32 and 48 done before the last chunk samples.
    assert stages == [("queued", 0.0), ("prompt_processing", 0.0)] + [
        ("prompt_processing", round(n / 50, 2)) for n in (16, 32, 48)
    ]
