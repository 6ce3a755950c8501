"""Steps that overlap (``--overlap-steps``): a step's draw is read while the next step's forward runs.

On the CPU nothing runs ahead (a forward is done when it returns), so these tests check what the
overlap must not change (every output equals the engine's without it) and the order it works in:
the next forward is launched, with the undrawn tokens as placeholders the device fills, before the
host reads the draw.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from tests.unit.worker.test_engine import collect, greedy, make_engine, request, token_ids
from worker.config import parse_config
from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.model.fake_runner import FakeRunner, load_fake_model
from worker.model.loader import load_model
from worker.model.step_inputs import fed_ids
from worker.sampling.grammar import GrammarCompiler, GrammarSpec
from worker.server import eos_token_ids, overlaps
from worker.types import (
    ContentDelta,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingOptions,
    Usage,
)

pytestmark = pytest.mark.slow  # left out of make test-fast


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def compiler(loaded):
    return GrammarCompiler(loaded.tokenizer, eos_token_ids(loaded.model, loaded.tokenizer))


def test_placeholders_take_the_previous_draw_on_the_device() -> None:
    drawn = torch.tensor([70, 71, 72])
    ids = torch.tensor([[5], [-3], [9], [-1]])
    assert fed_ids(ids, drawn).tolist() == [[5], [72], [9], [70]]
    assert fed_ids(ids, None) is ids


def varied_requests(compiler: GrammarCompiler) -> list[GenerationRequest]:
    """Requests that use every per-row sampling state the draw reads: seeds, filters, penalties,
    logprobs, n > 1, stop ids, a grammar, ends at different steps."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = compiler.validate(GrammarSpec("json_schema", schema=schema))
    rng = random.Random(11)
    prompts = [[rng.randrange(20, 1000) for _ in range(n)] for n in (5, 23, 9, 40, 14, 7, 31)]
    options: list[dict[str, Any]] = [
        {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True},
        {"temperature": 0.9, "top_p": 0.8, "seed": 5, "max_tokens": 30, "logprobs": 3},
        {"temperature": 1.0, "seed": 2, "max_tokens": 20, "n": 2, "repetition_penalty": 1.3},
        {
            "temperature": 0.7,
            "top_k": 20,
            "seed": 9,
            "max_tokens": 16,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.4,
        },
        # Half the vocabulary stops it, once 5 tokens are out: it ends by a token, mid-batch.
        {
            "temperature": 1.0,
            "seed": 4,
            "max_tokens": 40,
            "min_tokens": 5,
            "stop_token_ids": tuple(range(0, 49152, 2)),
        },
        {"temperature": 0.0, "max_tokens": 3, "logprobs": 0},
    ]
    requests = [
        GenerationRequest(
            f"r{i}", tuple(prompt), SamplingOptions(**opts), time.monotonic(), return_token_ids=True
        )
        for i, (prompt, opts) in enumerate(zip(prompts, options, strict=False))
    ]
    requests.append(
        GenerationRequest(
            "json",
            tuple(prompts[6]),
            SamplingOptions(temperature=1.0, seed=8, max_tokens=60),
            time.monotonic(),
            return_token_ids=True,
            grammar=grammar,
        )
    )
    return requests


def outputs_of(events: list) -> list:
    """What a caller reads: per choice, its deltas joined (text, ids, logprobs: how many steps one
    message carries depends on how far the caller lagged), then the ends (less their timings) and
    the usage. Logprob values are left out: :func:`logprob_values` has them."""
    joined: dict[int, tuple[str, tuple, tuple]] = {}
    rest = []
    for e in events:
        if isinstance(e, ContentDelta):
            text, ids, logprobs = joined.get(e.choice_index, ("", (), ()))
            bare = tuple(
                replace(lp, logprob=0.0, top=tuple(replace(t, logprob=0.0) for t in lp.top))
                for lp in e.logprobs
            )
            joined[e.choice_index] = (text + e.text, ids + e.token_ids, logprobs + bare)
        elif isinstance(e, (Finished, Usage)):
            rest.append(replace(e, timings=None) if isinstance(e, Finished) else e)
    return [sorted(joined.items()), rest]


def logprob_values(events: list) -> list[float]:
    """Every logprob value the caller reads, in order (each token's, then its alternatives')."""
    return [
        value
        for e in events
        if isinstance(e, ContentDelta)
        for lp in e.logprobs
        for value in (lp.logprob, *(t.logprob for t in lp.top))
    ]


def test_every_output_is_unchanged_by_the_overlap(loaded, compiler) -> None:
    """The same mixed batch through a small pool (chunked prompts, preemptions) with and without
    the overlap: identical tokens, logprobs, texts, ends and usage."""
    results = {}
    for overlap in (False, True):
        eng = make_engine(
            loaded,
            prefill_budget_tokens=16,
            pool_tokens=192,
            block_size=8,
            max_running=8,
            overlap=overlap,
            grammars=compiler,
        )
        requests = [r for r in varied_requests(compiler)]

        async def run_all(eng: Engine = eng, requests: list[GenerationRequest] = requests) -> list:
            return await asyncio.gather(*[collect(eng, r) for r in requests])

        try:
            results[overlap] = asyncio.run(asyncio.wait_for(run_all(), timeout=300))
            stats = eng.stats()
        finally:
            eng.stop()
        assert stats.kv_blocks_used == 0 and stats.running_requests == 0
        if overlap:
            assert stats.counters.preemptions > 0  # the pool was crowded enough to preempt
    for plain, overlapped in zip(results[False], results[True], strict=True):
        assert outputs_of(overlapped) == outputs_of(plain)
        # Equal to float32 rounding: which rows share a forward (the requests' arrival against
        # the steps) may change a matmul's summation order, never a token.
        assert logprob_values(overlapped) == pytest.approx(logprob_values(plain), rel=1e-5, abs=1e-6)
    ends = {e.reason for events in results[True] for e in events if isinstance(e, Finished)}
    assert FinishReason.STOP in ends and FinishReason.LENGTH in ends


def test_greedy_equals_generate_with_the_overlap_under_chunking_and_prefix_hits(loaded) -> None:
    rng = random.Random(3)
    shared = [rng.randrange(3, 1000) for _ in range(24)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (3, 17, 9, 30)]
    eng = make_engine(loaded, prefill_budget_tokens=16, prefix_caching=True, block_size=8, overlap=True)

    async def run_all() -> list:
        first = await collect(eng, request(prompts[0], temperature=0.0, max_tokens=12, min_tokens=12))
        rest = await asyncio.gather(
            *[collect(eng, request(p, temperature=0.0, max_tokens=12, min_tokens=12)) for p in prompts[1:]]
        )
        return [first, *rest]

    try:
        results = asyncio.run(asyncio.wait_for(run_all(), timeout=300))
        stats = eng.stats()
    finally:
        eng.stop()
    for prompt, events in zip(prompts, results, strict=True):
        assert token_ids(events) == greedy(loaded, prompt, 12)
    assert stats.counters.prefix_cache_hit_tokens >= 3 * 24
    assert stats.kv_blocks_used == 0


class Recording:
    """Wraps a runner: logs each forward (with whether it was fed the previous draw and its
    placeholder tokens) and each wait for a draw."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.log: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def execute(self, work: Any, fed: torch.Tensor | None = None) -> torch.Tensor:
        placeholders = [t for item in work for t in item.tokens if t < 0]
        self.log.append(("forward", (fed is not None, placeholders)))
        return self._inner.execute(work, fed)

    def ready(self) -> Any:
        wait = self._inner.ready()

        def logged() -> None:
            self.log.append(("read", None))
            wait()

        return logged


def recorded(loaded: Any, tokens: int, *, overlap: bool) -> list[tuple[str, Any]]:
    """The forwards and reads of one greedy request of ``tokens`` tokens (:class:`Recording`)."""
    eng = make_engine(loaded, prefill_budget_tokens=64, overlap=overlap)
    recording = Recording(eng._runner)
    eng._runner = eng._update._runner = recording  # type: ignore[assignment]  # it forwards, the update waits
    try:
        asyncio.run(
            collect(eng, request([30, 31, 32, 33], temperature=0.0, max_tokens=tokens, min_tokens=tokens))
        )
    finally:
        eng.stop()
    return recording.log


def test_the_next_forward_is_launched_before_the_draw_is_read(loaded) -> None:
    log = recorded(loaded, 4, overlap=True)
    kinds = [kind for kind, _ in log]
    # The prompt's forward, then every later forward before the read of the draw it follows; the
    # last draw (the 4th token) ends the request while a fifth forward runs, which is discarded.
    assert kinds == ["forward", "forward", "read", "forward", "read", "forward", "read", "forward", "read"]
    forwards = [detail for kind, detail in log if kind == "forward"]
    assert forwards[0] == (False, [])
    assert all(fed and placeholders == [-1] for fed, placeholders in forwards[1:])


def test_without_the_overlap_each_draw_is_read_before_the_next_forward(loaded) -> None:
    log = recorded(loaded, 3, overlap=False)
    assert [kind for kind, _ in log] == ["forward", "read"] * 3
    assert all(detail == (False, []) for kind, detail in log if kind == "forward")


def test_cancellations_with_draws_in_flight_leave_nothing_behind(loaded) -> None:
    eng = make_engine(loaded, prefill_budget_tokens=64, max_running=8, overlap=True)
    rng = random.Random(5)

    async def one() -> None:
        stream = eng.submit(
            request([rng.randrange(20, 900) for _ in range(6)], max_tokens=100, ignore_eos=True)
        )
        seen, limit = 0, rng.randrange(1, 8)
        async for _ in stream:
            seen += 1
            if seen >= limit:
                break  # closing the iterator aborts, usually while its row's draw is in flight

    async def run_all() -> Any:
        await asyncio.gather(*[one() for _ in range(40)])
        for _ in range(100):
            stats = eng.stats()
            if not stats.running_requests and not stats.waiting_requests:
                return stats
            await asyncio.sleep(0.05)
        return eng.stats()

    try:
        stats = asyncio.run(run_all())
    finally:
        eng.stop()
    assert stats.running_requests == 0 and stats.waiting_requests == 0
    assert stats.kv_blocks_used == 0 and stats.live_caches == 0
    assert stats.counters.requests_cancelled + stats.counters.requests_finished == 40


def test_the_fake_device_runs_beside_the_host() -> None:
    """The fake runner's notional device: a forward returns at once, its fence waits out the
    forward's time after the forwards queued before it."""
    # Forwards of 500 ms: queueing two takes a small part of one even on a loaded machine.
    runner = FakeRunner(load_fake_model(None), num_blocks=64, block_size=16, step_ms=500)
    from worker.model.step_inputs import Work

    started = time.monotonic()
    runner.execute([Work((1,), 0, (0,), True)])
    runner.execute([Work((1,), 1, (0,), True)])
    launched = time.monotonic()
    runner.ready()()
    assert launched - started < 0.5  # nothing waited for the device
    assert time.monotonic() - started >= 1.0  # two forwards of 500 ms, one after the other


def test_overlap_steps_setting() -> None:
    def config(*args: str) -> Any:
        return parse_config(["--fake-tokens", *args], environ={})

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert overlaps(config(), cuda, None) and not overlaps(config(), cpu, None)
    assert not overlaps(config(), cuda, object())  # type: ignore[arg-type]  # speculation: off
    assert overlaps(config("--overlap-steps", "on"), cpu, None)
    assert not overlaps(config("--overlap-steps", "off"), cuda, None)
    with pytest.raises(SystemExit):
        parse_config(["--overlap-steps", "on", "--speculative", "ngram"], environ={})
    with pytest.raises(ValueError, match="speculative"):
        Engine(
            FakeRunner(load_fake_model(None), num_blocks=64, block_size=16),
            None,
            eos_token_ids=(),
            context_length=128,
            speculation=object(),  # type: ignore[arg-type]
            options=EngineOptions(overlap=True),
        )
