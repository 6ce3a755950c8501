"""A chat request's thinking budget: ``thinking_token_budget`` as given, or ``reasoning_effort`` as the
family's own effort switch (gpt-oss's template) or else as a budget; the family's block and its end's
ids for the engine (worker/sampling/thinking_budget.py; docs/worker.md, "Thinking budgets")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from sluice.v1 import worker_pb2 as pb
from worker.errors import InvalidRequest
from worker.formats.registry import thinking_block
from worker.prompts.prompt import ChatPrompt, RawPrompt
from worker.types import ThinkingBudget

#: ``reasoning_effort`` as a thinking budget, for the families without an effort switch.
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384}
EFFORT_SWITCH = "reasoning_effort"  # the template variable of a family that has one (gpt-oss)


def thinking_request(chat: pb.ChatInput) -> tuple[int | None, str]:
    """The chat's budget (None: unset) and effort (""), the effort checked."""
    effort = chat.reasoning_effort
    if effort and effort not in EFFORT_BUDGETS:
        raise InvalidRequest(
            f"reasoning_effort must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}",
            param="reasoning_effort",
        )
    return (chat.thinking_token_budget if chat.HasField("thinking_token_budget") else None), effort


def with_effort(prompt: ChatPrompt | RawPrompt, effort: str, switch: str) -> ChatPrompt | RawPrompt:
    """The prompt with the effort as its template's own switch, where the family has one (a value the
    caller set in ``chat_template_kwargs`` wins)."""
    if not effort or switch != EFFORT_SWITCH or not isinstance(prompt, ChatPrompt):
        return prompt
    if EFFORT_SWITCH in prompt.template_kwargs:
        return prompt
    return dataclasses.replace(prompt, template_kwargs={**prompt.template_kwargs, EFFORT_SWITCH: effort})


def thinking_budget(
    budget: int | None,
    effort: str,
    *,
    switch: str,
    reasoning_parser: str,
    starts_thinking: bool,
    encode: Callable[[str], list[int]],
) -> ThinkingBudget | None:
    """The engine's budget for a request whose output is parsed for thinking, or None (no cap asked,
    or an effort the template took)."""
    if budget is None and effort and switch != EFFORT_SWITCH:
        budget = EFFORT_BUDGETS[effort]
    open_text, close_text = thinking_block(reasoning_parser)
    if budget is None or not close_text:
        return None
    return ThinkingBudget(budget, open_text, close_text, tuple(encode(close_text)), starts_thinking)
