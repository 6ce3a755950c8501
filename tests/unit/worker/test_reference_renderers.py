"""The template matrix against the families' reference renderers: the worker's prompt ids for each
scenario equal harmony's encoder for gpt-oss (its template patched by worker/service/template_fixes.py)
and mistral-common's request encoding for Mistral's tekken tokenizers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.unit.worker.test_families import BY_NAME, SCENARIOS, WEATHER, fixture_dir, setup
from worker.service.prompt import ChatMessage, ChatPrompt, PromptRenderer

__all__ = ["fixture_dir"]  # the session fixture, shared with test_families


@pytest.fixture(scope="module")
def harmony(fixture_dir: Path, monkeypatch_module: pytest.MonkeyPatch) -> Any:
    """harmony's gpt-oss encoding, reading the o200k_base.tiktoken that tools/fixtures.py rebuilt."""
    import openai_harmony

    monkeypatch_module.setenv("TIKTOKEN_ENCODINGS_BASE", str(fixture_dir / "tiktoken"))
    return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    patch = pytest.MonkeyPatch()
    yield patch
    patch.undo()


def _second_turn() -> ChatPrompt:
    """Instructions with tools, and an earlier answer whose reasoning the next prompt drops."""
    return ChatPrompt(
        (
            ChatMessage("system", "Be brief."),
            ChatMessage("user", "Hello"),
            ChatMessage("assistant", "Hi!", reasoning_content="Greet back."),
            ChatMessage("user", "Weather in Paris?"),
        ),
        tools=(WEATHER,),
    )


GPT_OSS_SCENARIOS = {**SCENARIOS, "second-turn": _second_turn}


def harmony_conversation(scenario: str, date: str) -> list[Any]:
    """The scenario built with harmony's own classes (what the model was trained on)."""
    from openai_harmony import (
        Author,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    effort = ReasoningEffort.LOW if scenario == "thinking-off" else ReasoningEffort.MEDIUM
    system = SystemContent.new().with_reasoning_effort(effort).with_conversation_start_date(date)
    messages = [Message.from_role_and_content(Role.SYSTEM, system)]
    tools = [ToolDescription.new(WEATHER["name"], WEATHER["description"], parameters=WEATHER["parameters"])]
    developer = DeveloperContent.new()
    if scenario in ("plain", "second-turn"):
        developer = developer.with_instructions("Be brief.")
    if scenario in ("tools", "call-and-result", "second-turn"):
        developer = developer.with_function_tools(tools)
    if scenario in ("plain", "tools", "call-and-result", "second-turn"):
        messages.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    user = {"plain": "Hello", "tools": "Weather in Paris?", "call-and-result": "Weather in Paris?"}
    if scenario == "second-turn":
        messages += [
            Message.from_role_and_content(Role.USER, "Hello"),
            Message.from_role_and_content(Role.ASSISTANT, "Greet back.").with_channel("analysis"),
            Message.from_role_and_content(Role.ASSISTANT, "Hi!").with_channel("final"),
            Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        ]
    else:
        messages.append(Message.from_role_and_content(Role.USER, user.get(scenario, "Hi")))
    if scenario == "call-and-result":
        messages += [
            Message.from_role_and_content(Role.ASSISTANT, "I should look it up.").with_channel("analysis"),
            Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}')
            .with_channel("commentary")
            .with_recipient("functions.get_weather")
            .with_content_type("<|constrain|>json"),
            Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), "20 C and sunny")
            .with_recipient("assistant")
            .with_channel("commentary"),
        ]
    return messages


@pytest.mark.parametrize("scenario", GPT_OSS_SCENARIOS)
def test_gpt_oss_prompts_equal_harmonys_encoder(fixture_dir: Path, harmony: Any, scenario: str) -> None:
    """Token for token, with one legitimate difference handled: the template writes today's date
    (``strftime_now``), harmony the date it is given, so the reference gets the rendered date."""
    from openai_harmony import Conversation, Role

    tok, profile = setup(fixture_dir, BY_NAME["gpt-oss"])
    assert profile.template_patched
    ids, text = PromptRenderer(tok, profile).render(GPT_OSS_SCENARIOS[scenario]())
    date = re.search(r"Current date: (\d{4}-\d{2}-\d{2})", text)
    assert date is not None
    conversation = Conversation.from_messages(harmony_conversation(scenario, date.group(1)))
    expected = harmony.render_conversation_for_completion(conversation, Role.ASSISTANT)
    assert list(ids) == list(expected), f"{text!r}\n!=\n{tok.decode(expected)!r}"
