"""The fake-token runner (``--fake-tokens``) alone, inside the real engine, and its settings."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import torch

from worker.config import parse_config
from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.errors import InvalidRequest
from worker.model.fake_runner import PASSAGE, SOURCE_PREFIX, FakeRunner, load_fake_model
from worker.model.loader import DEFAULT_MODEL_ID, ModelLoadError
from worker.model.step_inputs import Work
from worker.server import eos_token_ids
from worker.types import ContentDelta, Finished, FinishReason, GenerationRequest, SamplingOptions, Usage


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_fake_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def passage_ids(loaded) -> list[int]:
    return loaded.tokenizer(PASSAGE, add_special_tokens=False)["input_ids"]


def engine_for(loaded, step_ms: float = 0.0) -> Engine:
    engine = Engine(
        FakeRunner(loaded, num_blocks=1024, block_size=16, step_ms=step_ms),
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        options=EngineOptions(max_running=8, max_queue=100),
    )
    engine.start()
    return engine


def request(max_tokens: int, **sampling) -> GenerationRequest:
    return GenerationRequest(
        f"r{random.random()}", (5, 6, 7), SamplingOptions(max_tokens=max_tokens, **sampling), time.monotonic()
    )


async def collect(engine: Engine, req: GenerationRequest) -> list:
    return [event async for event in engine.submit(req)]


def text_of(events: list, choice: int = 0) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta) and e.choice_index == choice)


def test_loads_only_the_tokenizer_and_says_it_is_fake(loaded, tiny_model_dir):
    assert loaded.model is None
    assert loaded.source.startswith(SOURCE_PREFIX) and str(tiny_model_dir) in loaded.source
    assert loaded.model_id == Path(tiny_model_dir).name
    assert loaded.context_length == 512  # from the folder's config.json
    renamed = load_fake_model(str(tiny_model_dir), served_model_name="bench-model")
    assert renamed.model_id == "bench-model"


def test_default_model_tokenizer_comes_from_the_converted_cache(model_cache):
    started = time.monotonic()
    loaded = load_fake_model(None, cache_dir=model_cache)
    print(f"default tokenizer from the cache in {time.monotonic() - started:.2f}s")
    assert loaded.model_id == DEFAULT_MODEL_ID and loaded.context_length == 8192
    assert str(model_cache) in loaded.source


def test_missing_gguf_is_a_clear_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_fake_model(str(tmp_path / "missing.gguf"))


def test_runner_picks_each_sequence_s_next_passage_token(loaded, passage_ids):
    runner = FakeRunner(loaded, num_blocks=64, block_size=16)
    # A prompt chunk that samples, one that does not, and decode rows at several points of the passage
    # (past its end it starts again).
    work = [
        Work([1, 2, 3], 0, [0], True, generated=0),
        Work([4, 5], 0, [1], False, generated=0),
        Work([9], 20, [2, 3], True, generated=5),
        Work([9], 40, [4, 5, 6], True, generated=len(passage_ids) + 1),
    ]
    logits = runner.execute(work)
    assert logits.shape == (3, len(loaded.tokenizer))
    assert torch.softmax(logits, -1).max(-1).values.min() > 0.999  # all the mass on one token
    assert logits.argmax(-1).tolist() == [passage_ids[0], passage_ids[5], passage_ids[1]]
    assert runner.pool_bytes == 0
    with pytest.raises(ValueError, match="at least one item"):
        runner.execute([])


def test_a_narrow_fake_vocabulary_streams_ordinary_tokens_below_it(loaded, passage_ids):
    """``--fake-vocab``: logits that wide, the passage remapped onto the ordinary tokens below it."""
    narrow = FakeRunner(loaded, num_blocks=64, block_size=16, vocab=64)
    work = [Work([9], 20 + i, [2, 3], True, generated=i) for i in range(len(passage_ids))]
    logits = narrow.execute(work)
    assert logits.shape == (len(passage_ids), 64)
    picked = logits.argmax(-1).tolist()
    assert all(token < 64 and token not in loaded.tokenizer.all_special_ids for token in picked)
    assert len(set(picked)) > 10  # the passage's variety, not one token
    with pytest.raises(ValueError, match="only special tokens"):
        FakeRunner(loaded, num_blocks=64, block_size=16, vocab=1 + min(loaded.tokenizer.all_special_ids))


def test_engine_streams_the_passage_greedy_or_sampled(loaded, passage_ids):
    engine = engine_for(loaded)
    try:
        greedy, sampled, two = asyncio.run(
            _gather(engine, request(40, temperature=0.0), request(40), request(12, n=2))
        )
    finally:
        engine.stop()
    expected = loaded.tokenizer.decode(passage_ids[:40])
    assert text_of(greedy) == expected and text_of(sampled) == expected
    finished = next(e for e in greedy if isinstance(e, Finished))
    assert finished.reason is FinishReason.LENGTH and finished.completion_tokens == 40
    assert isinstance(greedy[-1], Usage) and greedy[-1].completion_tokens == 40
    assert text_of(two, 0) == text_of(two, 1) == loaded.tokenizer.decode(passage_ids[:12])


def test_stop_string_ends_a_fake_stream(loaded):
    engine = engine_for(loaded)
    try:
        events = asyncio.run(collect(engine, request(100, stop=("mill",))))
    finally:
        engine.stop()
    assert text_of(events) == "The river ran quietly past the old "
    assert next(e for e in events if isinstance(e, Finished)).reason is FinishReason.STOP


def test_step_pacing_sleeps_each_forward(loaded):
    engine = engine_for(loaded, step_ms=30)
    try:
        started = time.monotonic()
        events = asyncio.run(collect(engine, request(6, temperature=0.0)))
        elapsed = time.monotonic() - started
    finally:
        engine.stop()
    print(f"6 tokens at 30 ms a forward: {elapsed:.3f}s")
    assert next(e for e in events if isinstance(e, Finished)).completion_tokens == 6
    assert elapsed >= 6 * 0.030  # one prefill and five decodes, each sleeping 30 ms


def test_runner_rejects_negative_pacing(loaded):
    with pytest.raises(ValueError, match="step_ms"):
        FakeRunner(loaded, num_blocks=16, block_size=16, step_ms=-1)


def test_flags_and_environment():
    config = parse_config(["--fake-tokens", "--fake-step-ms", "20"], environ={})
    assert config.fake_tokens and config.fake_step_ms == 20.0
    assert not parse_config([], environ={}).fake_tokens
    from_env = parse_config(
        [], environ={"SLUICE_WORKER_FAKE_TOKENS": "yes", "SLUICE_WORKER_FAKE_STEP_MS": "5"}
    )
    assert from_env.fake_tokens and from_env.fake_step_ms == 5.0
    assert not parse_config([], environ={"SLUICE_WORKER_FAKE_TOKENS": "0"}).fake_tokens


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--fake-step-ms", "20"], {}, "--fake-step-ms only applies with --fake-tokens"),
        (["--fake-vocab", "64"], {}, "--fake-vocab only applies with --fake-tokens"),
        (["--fake-tokens", "--fake-step-ms", "-1"], {}, "--fake-step-ms: must be 0 to 60000 ms"),
        (["--fake-tokens", "--fake-step-ms", "fast"], {}, "--fake-step-ms: must be a number of ms"),
        ([], {"SLUICE_WORKER_FAKE_TOKENS": "maybe"}, "SLUICE_WORKER_FAKE_TOKENS: must be on/off"),
    ],
)
def test_bad_settings_name_the_setting(argv, environ, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(argv, environ=environ)
    assert message in capsys.readouterr().err


async def _gather(engine: Engine, *requests: GenerationRequest) -> list[list]:
    return list(await asyncio.gather(*(collect(engine, r) for r in requests)))


def test_a_fake_worker_refuses_to_score_a_prompt_naming_the_field(loaded):
    engine = engine_for(loaded)
    try:
        with pytest.raises(InvalidRequest) as caught:
            engine.prepare(request(0, prompt_logprobs=1))
    finally:
        engine.stop()
    assert caught.value.param == "prompt_logprobs" and "fake-tokens" in caught.value.message
