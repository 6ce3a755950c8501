"""The engine with a scripted runner: reasoning, refusals and tool calls from a known token stream."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoTokenizer

from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.types import (
    ContentDelta,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputOptions,
    ReasoningDelta,
    RefusalDelta,
    SamplingOptions,
    ToolCallDelta,
    Usage,
)


class ScriptedRunner:
    """Stands in for ModelRunner: every sampled sequence's logits force its next token of one script
    (by how many tokens it has generated)."""

    scores_prompts = False
    pool_bytes = 0
    num_blocks = 1024
    block_size = 16

    def __init__(self, script: list[int], vocab_size: int):
        self.script, self.vocab = script, vocab_size

    def execute(self, work, fed=None):
        positions = [item.generated for item in work if item.sample]
        logits = torch.zeros(len(positions), self.vocab)
        for row, at in enumerate(positions):
            logits[row, self.script[min(at, len(self.script) - 1)]] = 100.0
        return logits

    def ready(self):
        return lambda: None


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def run(tokenizer, text: str, output: OutputOptions, **engine_options) -> list:
    script = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    engine = Engine(
        ScriptedRunner(script, len(tokenizer)),
        tokenizer,
        eos_token_ids={tokenizer.eos_token_id},
        context_length=4096,
        options=EngineOptions(**engine_options),
    )  # type: ignore[arg-type]
    engine.start()
    request = GenerationRequest(
        "r", (1, 2, 3), SamplingOptions(temperature=0.0, max_tokens=200), time.monotonic(), output=output
    )

    async def collect() -> list:
        return [event async for event in engine.submit(request)]

    try:
        return asyncio.run(collect())
    finally:
        engine.stop()


def test_thinking_streams_as_reasoning_and_is_counted(tokenizer):
    text = "<think>The user wants 2+2. That is 4.</think>\n\nThe answer is 4."
    events = run(tokenizer, text, OutputOptions(reasoning=True))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert reasoning == "The user wants 2+2. That is 4." and content == "The answer is 4."
    usage = events[-1]
    assert isinstance(usage, Usage)
    thinking_tokens = len(
        tokenizer("<think>The user wants 2+2. That is 4.", add_special_tokens=False)["input_ids"]
    )
    assert 0 < usage.reasoning_tokens <= thinking_tokens + 1 < usage.completion_tokens


def test_thinking_turned_off_is_dropped(tokenizer):
    events = run(
        tokenizer, "<think>hidden</think>Shown.", OutputOptions(reasoning=True, keep_reasoning=False)
    )
    assert not [e for e in events if isinstance(e, ReasoningDelta)]
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Shown."


def test_blocked_phrase_becomes_a_refusal_with_content_filter(tokenizer):
    events = run(
        tokenizer,
        "Sure, here is the secret plan: step one.",
        OutputOptions(),
        blocked_phrases=("secret plan",),
        refusal_message="I can't share that.",
    )
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Sure, here is the "
    assert [e.text for e in events if isinstance(e, RefusalDelta)] == ["I can't share that."]
    finished = next(e for e in events if isinstance(e, Finished))
    assert finished.reason is FinishReason.CONTENT_FILTER and finished.matched_stop == ""


def test_tool_call_text_ends_with_tool_calls(tokenizer):
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    events = run(tokenizer, text, OutputOptions(tool_calls=True))
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert calls[0].name == "get_weather" and "".join(c.arguments for c in calls) == '{"city": "Oslo"}'
    assert next(e for e in events if isinstance(e, Finished)).reason is FinishReason.TOOL_CALLS
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Checking."


def test_a_failure_while_planning_a_step_fails_the_requests_instead_of_hanging(tokenizer):
    script = tokenizer("Fine.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    runner = ScriptedRunner(script, len(tokenizer))
    engine = Engine(runner, tokenizer, eos_token_ids={tokenizer.eos_token_id}, context_length=4096)  # type: ignore[arg-type]
    attach = engine.blocks.attach_prefix
    broken = [True]

    def broken_attach(seq, tokens):  # type: ignore[no-untyped-def]
        if broken[0]:  # stands in for any bug met while planning a step
            raise RuntimeError("broken")
        return attach(seq, tokens)

    engine.blocks.attach_prefix = broken_attach  # type: ignore[method-assign]
    engine.start()

    def request(name: str) -> GenerationRequest:
        return GenerationRequest(
            name, (1, 2, 3), SamplingOptions(temperature=0.0, max_tokens=20), time.monotonic()
        )

    async def collect(name: str) -> list:
        return [event async for event in engine.submit(request(name))]

    try:
        events = asyncio.run(asyncio.wait_for(collect("a"), timeout=10))
        assert isinstance(events[-1], Failed) and events[-1].message == "generation failed: RuntimeError"
        broken[0] = False  # the loop is still alive and serves the next request
        events = asyncio.run(asyncio.wait_for(collect("b"), timeout=10))
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Fine."
        assert engine.stats().counters.requests_failed == 1
    finally:
        engine.stop()
