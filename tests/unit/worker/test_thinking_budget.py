"""Thinking budgets (issue 46): the engine, with a scripted runner that thinks on and on, and each thinking
family's real tokenizer: the reasoning stops at the budget with the family's own end of the block, and the
answer follows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from functools import cache
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.unit.worker.test_engine_reasoning import ScriptedRunner
from tools.fixtures import DEFAULT_DIR, build_tekken, fetch_tokenizer
from worker.engine.core import Engine
from worker.formats.registry import thinking_block
from worker.sampling.grammar import GrammarCompiler
from worker.sampling.thinking_budget import BudgetedThinking
from worker.types import (
    ContentDelta,
    GenerationRequest,
    OutputOptions,
    ReasoningDelta,
    SamplingOptions,
    ThinkingBudget,
    Usage,
)

ANSWER = "The answer is 4."
BUDGET = 6
# family -> (reasoning format, tokenizer fixture, the prompt opened the block, end-of-turn token, answer)
FAMILIES = {
    "qwen3": ("qwen3", "qwen3", False, "<|im_end|>", ANSWER),
    "deepseek_r1": ("deepseek_r1", "deepseek_v3", True, None, ANSWER),
    "gpt-oss": ("openai_gptoss", "gptoss", False, "<|return|>", ANSWER),
    "mistral": ("mistral", "tekken v13", False, "</s>", ANSWER),
    # Granite's markers are ordinary text: written as several tokens of a BPE vocabulary (Llama 3.1's).
    "granite": ("granite", "llama3_1", False, None, f"<response>{ANSWER}</response>"),
}


@cache
def tokenizer_of(fixture: str) -> Any:
    if fixture.startswith("tekken"):
        from worker.model.mistral_tokenizer import with_mistral_common

        tekken = build_tekken(DEFAULT_DIR, fixture.split()[1])
        return with_mistral_common(AutoTokenizer.from_pretrained(tekken), tekken)
    return AutoTokenizer.from_pretrained(fetch_tokenizer(fixture, DEFAULT_DIR))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _generate(family: str, budget: int | None) -> tuple[str, str, Usage]:
    """Runs a model that opens the block (unless the prompt did) and thinks without end, where the
    answer is scripted to come right after a budget's forced end; returns reasoning, content, usage."""
    parser, fixture, opened, end_turn, answer = FAMILIES[family]
    tokenizer = tokenizer_of(fixture)
    open_text, close_text = thinking_block(parser)
    close_ids = _ids(tokenizer, close_text)
    step = _ids(tokenizer, " step")[0]
    eos = tokenizer.convert_tokens_to_ids(end_turn) if end_turn else tokenizer.eos_token_id
    script = (
        ([] if opened else _ids(tokenizer, open_text))
        + [step] * (BUDGET + len(close_ids))  # the model would think on where the end is forced
        + _ids(tokenizer, answer)
        + [eos]
    )
    spec = (
        ThinkingBudget(budget, open_text, close_text, tuple(close_ids), opened)
        if budget is not None
        else None
    )
    output = OutputOptions(
        reasoning=True, reasoning_parser=parser, starts_thinking=opened, keep_special_tokens=True
    )
    engine = Engine(
        ScriptedRunner(script, len(tokenizer)),  # type: ignore[arg-type]
        tokenizer,
        eos_token_ids={eos},
        context_length=4096,
        grammars=GrammarCompiler(tokenizer, {eos}),
    )
    engine.start()
    request = GenerationRequest(
        "r",
        (1, 2, 3),
        SamplingOptions(temperature=0.0, max_tokens=len(script) + 4),
        time.monotonic(),
        output=output,
        thinking_budget=spec,
    )

    async def collect() -> list[Any]:
        return [event async for event in engine.submit(request)]

    try:
        events = asyncio.run(collect())
    finally:
        engine.stop()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    usage = events[-1]
    assert isinstance(usage, Usage)
    return reasoning, content, usage


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reasoning_stops_at_the_budget_and_the_answer_follows(family: str) -> None:
    reasoning, content, usage = _generate(family, BUDGET)
    assert reasoning.split() == ["step"] * BUDGET
    assert content.strip() == ANSWER
    # The budget's tokens, and at most the block's own markers besides.
    assert BUDGET <= usage.reasoning_tokens <= BUDGET + 2 * len(thinking_block(FAMILIES[family][0])[1])


def test_without_a_budget_the_same_model_never_stops_thinking() -> None:
    reasoning, content, _ = _generate("qwen3", None)
    assert reasoning.count("step") > BUDGET and ANSWER in reasoning and not content.strip()


def _decode_chars(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_budget_counts_only_inside_the_block_and_stops_counting_at_its_end() -> None:
    spec = ThinkingBudget(10, "<t>", "</t>", (ord("#"),))
    state = BudgetedThinking(spec, _decode_chars)
    for char in "ab<t>x</t>yy<t>zzzz":  # a block the model closed, text, a second block
        assert state.forced() is None
        state.record(ord(char))
    # "x</t>" counted in the first block, nothing between the blocks, "zzzz" in the second.
    assert state.spent == 9 and state.thinking and state.allowed_prefix() == 0
    state.record(ord("z"))
    assert state.spent == 10 and state.forced() == ord("#") and state.allowed_prefix() == 0
    state.record(ord("#"))
    assert not state.thinking and state.forced() is None


def test_a_zero_budget_ends_a_block_the_prompt_opened_at_once() -> None:
    state = BudgetedThinking(ThinkingBudget(0, "<t>", "</t>", (1, 2), starts_thinking=True), _decode_chars)
    assert state.forced() == 1
    state.record(1)
    assert state.forced() == 2
    state.record(2)
    assert state.forced() is None and not state.thinking
    fresh = BudgetedThinking(ThinkingBudget(10, "<t>", "</t>", (1,), starts_thinking=True), _decode_chars)
    assert fresh.allowed_prefix() == 9  # speculation never reaches the budget inside one step


def test_the_service_turns_a_budget_or_an_effort_into_the_engines_budget() -> None:
    from sluice.v1 import worker_pb2 as pb
    from worker.errors import InvalidRequest
    from worker.prompts.prompt import ChatMessage, ChatPrompt
    from worker.service.thinking import EFFORT_BUDGETS, thinking_budget, thinking_request, with_effort

    qwen3 = tokenizer_of("qwen3")
    encode = lambda text: _ids(qwen3, text)  # noqa: E731
    chat = pb.ChatInput(thinking_token_budget=0, reasoning_effort="high")
    assert thinking_request(chat) == (0, "high") and thinking_request(pb.ChatInput()) == (None, "")
    with pytest.raises(InvalidRequest) as refused:
        thinking_request(pb.ChatInput(reasoning_effort="extreme"))
    assert refused.value.param == "reasoning_effort"
    common = {"reasoning_parser": "qwen3", "starts_thinking": False, "encode": encode}
    given = thinking_budget(0, "high", switch="enable_thinking", **common)  # the budget wins
    assert given == ThinkingBudget(0, "<think>", "</think>", tuple(encode("</think>")))
    effort = thinking_budget(None, "low", switch="enable_thinking", **common)
    assert effort is not None and effort.tokens == EFFORT_BUDGETS["low"]
    assert thinking_budget(None, "", switch="enable_thinking", **common) is None
    # gpt-oss has an effort switch of its own: the effort goes to its template, no budget.
    assert thinking_budget(None, "low", switch="reasoning_effort", **common) is None
    prompt = ChatPrompt((ChatMessage(role="user", content="Hi"),))
    assert with_effort(prompt, "low", "reasoning_effort").template_kwargs == {"reasoning_effort": "low"}  # type: ignore[union-attr]
    assert with_effort(prompt, "low", "enable_thinking") is prompt
