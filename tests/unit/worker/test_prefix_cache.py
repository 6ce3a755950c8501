"""The prefix cache: its bookkeeping, and engine output with it on equal to sequential ``generate``."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tests.unit.worker.test_engine import collect, greedy, make_engine, request, token_ids
from worker.engine import Engine
from worker.metrics import render
from worker.model_loader import load_model
from worker.model_runner import ModelRunner
from worker.prefix_cache import PrefixCache
from worker.server import eos_token_ids
from worker.types import Finished, Usage


def fake_layers(prompt: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer KV whose values are the token ids, so a test can see which tokens it got."""
    ids = torch.tensor(prompt, dtype=torch.float32)[None, :, None]
    return [(ids + layer, -ids - layer) for layer in range(layers)]


def test_lookup_returns_the_longest_stored_whole_block_prefix_and_leaves_a_token():
    cache = PrefixCache(capacity_tokens=64, block_tokens=4)
    prompt = list(range(10, 20))  # 10 tokens: blocks [10..13], [14..17]
    cache.store(prompt, fake_layers(prompt))
    assert cache.tokens == 8
    length, layers = cache.lookup([*prompt, 99])
    assert length == 8 and layers[1][0][0, :, 0].tolist() == [t + 1.0 for t in prompt[:8]]
    assert cache.lookup(prompt[:8])[0] == 4  # the last token is always computed
    assert cache.lookup([10, 11, 12, 99, 14, 15, 16, 17, 1])[0] == 0  # a different first block
    assert cache.lookup([*prompt[:4], 0, 0, 0, 0, 1])[0] == 4
    assert PrefixCache(0).lookup(prompt) == (0, []) and not PrefixCache(0).enabled


def test_lru_eviction_drops_the_oldest_chain_from_its_end():
    cache = PrefixCache(capacity_tokens=12, block_tokens=4)
    a, b = [1] * 9, [2] * 9
    cache.store(a, fake_layers(a))  # 2 blocks
    cache.store(b, fake_layers(b))  # 2 more: a's second block (the oldest) goes first
    assert cache.tokens == 12
    assert cache.cached_length(a) == 4 and cache.cached_length(b) == 8
    c = [3] * 9
    cache.store(c, fake_layers(c))
    assert cache.tokens <= 12 and cache.cached_length(c) == 8 and cache.cached_length(a) == 0
    assert cache.cached_length(b) == 4  # b's first block outlives its second


def test_a_prompt_longer_than_the_cache_keeps_its_first_blocks():
    cache = PrefixCache(capacity_tokens=8, block_tokens=4)
    long = list(range(40))
    cache.store(long, fake_layers(long))
    assert cache.tokens == 8 and cache.cached_length(long) == 8


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


def test_prefill_from_cached_prefixes_matches_a_plain_prefill(loaded):
    rng = random.Random(1)
    shared = [rng.randrange(3, 1000) for _ in range(37)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (1, 9, 30)]
    prompts.append([rng.randrange(3, 1000) for _ in range(21)])  # shares nothing
    plain_logits, _ = ModelRunner(loaded).prefill(prompts)
    runner = ModelRunner(loaded, prefix_cache_tokens=1024)
    runner.prefill([[*shared, 5]])  # stores 32 tokens of the shared prefix
    logits, cache = runner.prefill(prompts)
    assert cache.prefix_lengths == [32, 32, 32, 0]
    assert cache.lengths == [len(p) for p in prompts]
    torch.testing.assert_close(logits, plain_logits, rtol=1e-4, atol=1e-4)


def test_prompts_of_one_prefill_share_a_prefix_computed_once(loaded):
    runner = ModelRunner(loaded, prefix_cache_tokens=1024)
    shared = list(range(100, 140))
    prompts = [[*shared, 7], [*shared, 8, 9], list(range(3, 23))]
    plain_logits, _ = ModelRunner(loaded).prefill(prompts)
    logits, cache = runner.prefill(prompts)
    assert cache.prefix_lengths == [40, 40, 0]  # the whole shared 40 tokens (5 blocks)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-4, atol=1e-4)


@pytest.fixture
def engine(loaded):
    eng = make_engine(loaded, prefill_budget_tokens=256, prefix_cache_tokens=4096)
    yield eng
    eng.stop()


def test_batched_greedy_with_prefix_cache_equals_sequential_generate(engine, loaded):
    rng = random.Random(7)
    shared = [rng.randrange(3, 1000) for _ in range(35)]
    first = [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (2, 13)]
    second = [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (1, 20, 40)]
    second += [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 33)]  # misses
    second.append(first[1] + [rng.randrange(3, 1000) for _ in range(4)])  # hits 48 tokens
    steps = 10

    async def run(prompts: list[list[int]]) -> list[list]:
        return await asyncio.gather(
            *[
                collect(engine, request(p, temperature=0.0, max_tokens=steps, min_tokens=steps, n=2))
                for p in prompts
            ]
        )

    results = asyncio.run(run(first)) + asyncio.run(run(second))
    prompts = first + second
    cached = []
    for prompt, events in zip(prompts, results, strict=True):
        expected = greedy(loaded, prompt, steps)
        assert token_ids(events, 0) == expected and token_ids(events, 1) == expected
        assert all(e.completion_tokens == steps for e in events if isinstance(e, Finished))
        usage = events[-1]
        assert isinstance(usage, Usage) and usage.prompt_tokens == len(prompt)
        cached.append(usage.cached_tokens)
    # The first two share 32 tokens, computed once for both; then the shared prefix hits,
    # the unrelated prompts miss, and the prompt extending first[1] reuses 48 tokens.
    assert cached == [32, 32, 32, 32, 32, 0, 0, 48]
    stats = engine.stats()
    assert stats.counters.prefix_cache_hit_tokens == sum(cached)
    text = render(stats, "tiny")
    assert f'sluice_worker_prefix_cache_hit_tokens_total{{model="tiny"}} {sum(cached)}' in text


def test_prefill_budget_counts_only_the_tokens_the_prefix_cache_lacks(loaded):
    """Three 60-token prompts whose first 56 tokens are cached cost 3 x 4 tokens of a 64-token
    prefill budget, so one step admits them all; three uncached ones (3 x 60) need three steps."""
    rng = random.Random(3)
    shared = [rng.randrange(3, 1000) for _ in range(56)]
    runner = ModelRunner(loaded, prefix_cache_tokens=4096)
    runner.prefill([[*shared, 1, 2]])  # stores the shared 56 tokens (7 blocks)
    engine = Engine(
        runner,
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        max_running=8,
        max_queue=100,
        prefill_budget_tokens=64,
    )  # not started: the test drives the scheduler itself

    async def admitted_per_step(prompts: list[list[int]]) -> list[int]:
        for prompt in prompts:
            engine.submit(request(prompt, max_tokens=4))
        sizes = []
        while plan := engine._scheduler.schedule().prefill:
            sizes.append(len(plan))
        return sizes

    warm = [[*shared, *(rng.randrange(3, 1000) for _ in range(4))] for _ in range(3)]
    cold = [[rng.randrange(3, 1000) for _ in range(60)] for _ in range(3)]
    assert asyncio.run(admitted_per_step(warm)) == [3]
    assert asyncio.run(admitted_per_step(cold)) == [1, 1, 1]
