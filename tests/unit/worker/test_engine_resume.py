"""Resuming a generation (stream migration): a request given the tokens an earlier call delivered
continues exactly as the undisturbed call did (tiny random Llama, in-process engine, no gRPC).

Each test runs a request once undisturbed, then plays the edge: it "delivers" the events up to a
delta that carried token ids, resumes a new request from those ids, and checks that the delivered
events plus the resumed call's events read exactly like the undisturbed run (text, tool calls,
finish, usage), at several cut points. The engine merges the deltas of steps its consumer has not
read yet, so the per-token events an edge could have seen are rebuilt by feeding the undisturbed
run's tokens to a fresh output processor one at a time (:func:`per_token_events`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import replace

import pytest

from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.errors import InvalidRequest
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.output.detokenizer import TokenTexts
from worker.output.processor import RequestOutputProcessor, TextRules
from worker.sampling.grammar import GrammarCompiler, GrammarSpec
from worker.server import eos_token_ids
from worker.types import (
    ContentDelta,
    Dequeued,
    Finished,
    FinishReason,
    GenerationRequest,
    NewToken,
    OutputOptions,
    Progress,
    ReasoningDelta,
    RefusalDelta,
    SamplingOptions,
    ToolCallDelta,
    Usage,
)

pytestmark = pytest.mark.slow  # left out of make test-fast

_DELTAS = (ContentDelta, ReasoningDelta, ToolCallDelta, RefusalDelta)
# Enums only: a random model's call is short and always complete.
UNITS = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def compiler(loaded):
    return GrammarCompiler(loaded.tokenizer, eos_token_ids(loaded.model, loaded.tokenizer))


@pytest.fixture(scope="module")
def engine(loaded, compiler):
    eng = Engine(
        ModelRunner(loaded, num_blocks=256, block_size=16),
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        # Small: a resumed request's prompt plus tokens is computed in several chunks.
        options=EngineOptions(max_running=8, prefill_budget_tokens=16),
        grammars=compiler,
    )
    eng.start()
    yield eng
    eng.stop()


# A real sentence: the tiny model's ids 0..16 are special tokens, which decode to nothing.
PROMPT = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def prompt(loaded) -> tuple[int, ...]:
    return tuple(loaded.tokenizer.encode(PROMPT))


def make_request(prompt: tuple[int, ...], **fields) -> GenerationRequest:
    output = fields.pop("output", OutputOptions())
    grammar = fields.pop("grammar", None)
    return GenerationRequest(
        f"r{random.random()}",
        prompt,
        SamplingOptions(**fields),
        time.monotonic(),
        return_token_ids=True,
        output=output,
        grammar=grammar,
    )


def run(engine: Engine, request: GenerationRequest) -> list:
    async def collect() -> list:
        return [e async for e in engine.submit(request) if not isinstance(e, Progress)]

    return asyncio.run(collect())


def per_token_events(loaded, request: GenerationRequest, events: list) -> list:
    """The undisturbed run's events as a consumer reading every step at once would have seen them:
    its tokens fed to a new output processor one per step, with the run's own token-level end."""
    ids = seen(events)["ids"]
    finished = next(e for e in events if isinstance(e, Finished))
    processor = RequestOutputProcessor(request, loaded.tokenizer, TokenTexts(loaded.tokenizer), TextRules())
    now = time.monotonic()
    out = processor.process([Dequeued(now, 0)]).events
    for position, token in enumerate(ids):
        last = position == len(ids) - 1 and finished.matched_stop_token_id is None
        end = finished.reason if last and not finished.matched_stop else None
        out += processor.process([NewToken(0, token, now, finish=end)]).events
    if finished.matched_stop_token_id is not None:
        stop = finished.matched_stop_token_id
        out += processor.process([NewToken(0, stop, now, finish=FinishReason.STOP, stop_token=stop)]).events
    fine = [e for e in out if not isinstance(e, Progress)]
    assert seen(fine) == seen(events)
    return fine


def cut_points(events: list) -> list[int]:
    """Positions of the deltas that carried token ids: where an edge may resume from."""
    return [i for i, e in enumerate(events) if isinstance(e, _DELTAS) and getattr(e, "token_ids", ())]


def resume_after(engine: Engine, request: GenerationRequest, events: list, cut: int) -> list:
    """What a client sees when the stream broke right after ``events[cut]`` and was resumed."""
    delivered = events[: cut + 1]
    ids = tuple(t for e in delivered if isinstance(e, _DELTAS) for t in getattr(e, "token_ids", ()))
    resumed = replace(request, request_id=f"{request.request_id}-resumed", resumed_token_ids=ids)
    return delivered + run(engine, resumed)


def seen(events: list) -> dict:
    """What a client reads from a stream (tool-call ids are random per call, so they are left out)."""
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            calls.setdefault(e.tool_index, [e.name, ""])[1] += e.arguments
    finished = [(f.reason, f.completion_tokens, f.matched_stop) for f in events if isinstance(f, Finished)]
    usage = [
        (u.prompt_tokens, u.completion_tokens, u.reasoning_tokens) for u in events if isinstance(u, Usage)
    ]
    return {
        "content": "".join(e.text for e in events if isinstance(e, ContentDelta)),
        "reasoning": "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        "refusal": "".join(e.text for e in events if isinstance(e, RefusalDelta)),
        "calls": calls,
        "ids": [t for e in events if isinstance(e, _DELTAS) for t in getattr(e, "token_ids", ())],
        "finished": finished,
        "usage": usage,
    }


def check_resumes(engine: Engine, loaded, request: GenerationRequest, *, every: int = 1) -> list:
    """Runs ``request`` undisturbed, then resumed after every ``every``-th cut point (the last cut
    point always); asserts each reads the same. Returns the undisturbed events, one step each."""
    undisturbed = per_token_events(loaded, request, run(engine, request))
    expected = seen(undisturbed)
    points = cut_points(undisturbed)
    assert len(points) > 2, "too short to test resuming"
    for cut in sorted({*points[::every], points[-1]}):
        assert seen(resume_after(engine, request, undisturbed, cut)) == expected, f"cut after event {cut}"
    return undisturbed


def test_greedy_resume_equals_undisturbed_run(engine, loaded, prompt):
    events = check_resumes(
        engine, loaded, make_request(prompt, temperature=0.0, max_tokens=24, min_tokens=24), every=2
    )
    assert seen(events)["finished"] == [(FinishReason.LENGTH, 24, "")]


def test_seeded_resume_draws_what_the_undisturbed_run_drew(engine, loaded, prompt):
    check_resumes(
        engine, loaded, make_request(prompt, temperature=1.0, top_p=0.9, seed=1234, max_tokens=20), every=2
    )


def test_penalties_count_the_resumed_tokens(engine, loaded, prompt):
    request = make_request(
        prompt,
        temperature=0.0,
        max_tokens=24,
        presence_penalty=0.8,
        frequency_penalty=1.2,
        repetition_penalty=1.5,
    )
    check_resumes(engine, loaded, request, every=3)


def test_stop_string_within_the_resumed_tokens_ends_the_choice(engine, loaded, prompt):
    base = seen(run(engine, make_request(prompt, temperature=0.0, max_tokens=30, min_tokens=30)))["content"]
    # The stop string whose first occurrence comes latest, so there is something to resume before it.
    first_seen = [i for i in range(len(base) - 4) if base.find(base[i : i + 4]) == i]
    stop = base[max(first_seen) : max(first_seen) + 4]
    events = check_resumes(engine, loaded, make_request(prompt, temperature=0.0, max_tokens=30, stop=(stop,)))
    finished = seen(events)["finished"]
    assert finished[0][0] is FinishReason.STOP and finished[0][2] == stop


def test_resume_at_max_tokens_only_finishes(engine, prompt):
    request = make_request(prompt, temperature=0.0, max_tokens=8, min_tokens=8)
    undisturbed = run(engine, request)
    ids = tuple(seen(undisturbed)["ids"])
    assert len(ids) == 8
    resumed = run(engine, replace(request, resumed_token_ids=ids))
    assert [
        type(e) for e in resumed if isinstance(e, _DELTAS) and (e.text if hasattr(e, "text") else True)
    ] == []
    assert next(e for e in resumed if isinstance(e, Finished)).completion_tokens == 8
    assert next(e for e in resumed if isinstance(e, Usage)).completion_tokens == 8


def test_grammar_is_advanced_past_the_resumed_tokens(engine, compiler, loaded, prompt):
    source = compiler.validate(GrammarSpec("tool_call", functions=(("forecast", UNITS),)))
    request = make_request(
        prompt, temperature=1.0, seed=3, max_tokens=200, output=OutputOptions(tool_calls=True), grammar=source
    )
    events = check_resumes(engine, loaded, request, every=4)
    call = seen(events)["calls"][0]
    assert call[0] == "forecast" and set(json.loads(call[1])) == {"unit", "days"}


def test_resumed_tokens_the_grammar_refuses_are_an_invalid_request(engine, compiler, loaded, prompt):
    source = compiler.validate(GrammarSpec("json_object"))
    bad = tuple(loaded.tokenizer.encode("hello", add_special_tokens=False))
    request = replace(make_request(prompt, max_tokens=50, grammar=source), resumed_token_ids=bad)
    with pytest.raises(InvalidRequest) as caught:
        engine.prepare(request)
    assert caught.value.param == "resume"


def test_resume_needs_a_single_choice(engine, prompt):
    request = replace(make_request(prompt, max_tokens=8, n=2), resumed_token_ids=(10, 11))
    with pytest.raises(InvalidRequest) as caught:
        engine.prepare(request)
    assert caught.value.param == "resume"


def test_resume_after_the_tail_was_sent_sends_only_the_finish(loaded):
    """The earlier call flushed the text its parsers held back and put the ids on that last delta,
    then ended with EOS; only ``finished`` was lost. The resumed call draws EOS again and sends just
    ``finished``: no tail, no tool call twice."""
    tokenizer, eos = loaded.tokenizer, eos_token_ids(loaded.model, loaded.tokenizer)
    text = 'Sure. <tool_call>\n{"name": "forecast", "arguments": {"days": 2}}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = min(eos)
    request = make_request((1, 2, 3), temperature=0.0, max_tokens=100, output=OutputOptions(tool_calls=True))

    def feed(processor: RequestOutputProcessor, tokens: list[int]) -> list:
        out = processor.process([Dequeued(time.monotonic(), 0)]).events
        for token in tokens:
            out += processor.process([NewToken(0, token, time.monotonic())]).events
        end = NewToken(0, stop, time.monotonic(), finish=FinishReason.STOP, stop_token=stop)
        return out + processor.process([end]).events

    texts = TokenTexts(tokenizer)
    undisturbed = feed(RequestOutputProcessor(request, tokenizer, texts, TextRules()), ids)
    expected = seen(undisturbed)
    assert expected["calls"] == {0: ["forecast", '{"days": 2}']}
    for cut in cut_points(undisturbed):
        delivered = undisturbed[: cut + 1]
        sent = tuple(t for e in delivered if isinstance(e, _DELTAS) for t in getattr(e, "token_ids", ()))
        resumed_request = replace(request, resumed_token_ids=sent)
        resumed = feed(
            RequestOutputProcessor(resumed_request, tokenizer, texts, TextRules()), ids[len(sent) :]
        )
        assert seen(delivered + resumed) == expected, f"cut after event {cut}"
