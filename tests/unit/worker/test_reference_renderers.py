"""The template matrix against the families' reference renderers: the worker's prompt ids for each
scenario equal harmony's encoder for gpt-oss (its template patched by worker/prompts/template_fixes.py)
and mistral-common's request encoding for Mistral's tekken tokenizers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.unit.worker.test_families import BY_NAME, SCENARIOS, WEATHER, fixture_dir, setup
from worker.prompts.prompt import ChatMessage, ChatPrompt, PromptRenderer

pytestmark = pytest.mark.slow  # left out of make test-fast

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


TEKKEN_VERSIONS = ("v3", "v7", "v11", "v13")


def tekken(fixture_dir: Path, version: str) -> tuple[Any, Any]:
    """The tekken folder's tokenizer as the worker loads it (transformers' class for it, turned into
    the fast tokenizer carrying mistral-common's) and its profile."""
    from transformers import AutoTokenizer

    from worker.model.mistral_tokenizer import with_mistral_common
    from worker.prompts.family import choose_profile

    if version not in _TEKKEN:
        folder = fixture_dir / f"mistral_tekken_{version}"
        tok = with_mistral_common(AutoTokenizer.from_pretrained(folder), folder)
        _TEKKEN[version] = (tok, choose_profile("mistral", tok))
    return _TEKKEN[version]


_TEKKEN: dict[str, tuple[Any, Any]] = {}


def openai_messages(prompt: ChatPrompt, thinks: bool) -> list[dict[str, Any]]:
    """The scenario as an OpenAI request body's messages, ids as Mistral's nine alphanumerics."""
    from worker.prompts.family import nine_char_id

    messages: list[dict[str, Any]] = []
    for m in prompt.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": nine_char_id(c["id"]),
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            message.update(tool_call_id=nine_char_id(m.tool_call_id), name=m.name)
        if m.reasoning_content and thinks:
            message["reasoning_content"] = m.reasoning_content
        messages.append(message)
    return messages


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("version", TEKKEN_VERSIONS)
def test_mistral_prompts_equal_mistral_commons_encoding(
    fixture_dir: Path, version: str, scenario: str
) -> None:
    """The reference: mistral-common's own OpenAI conversion (``ChatCompletionRequest.from_openai``)
    and ``encode_chat_completion``. Earlier reasoning is shown from v13 on (``[THINK]``); before, no
    Mistral format has a place for it."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    from worker.model.mistral_tokenizer import mistral_common_of
    from worker.prompts.mistral_prompt import mistral_thinks

    tok, profile = tekken(fixture_dir, version)
    assert (profile.family, profile.tool_parser, profile.nine_char_ids) == ("mistral", "mistral", True)
    prompt = SCENARIOS[scenario]()
    ids, text = PromptRenderer(tok, profile).render(prompt)
    mistral = mistral_common_of(tok)
    tools = [{"type": "function", "function": t} for t in prompt.tools] or None
    request = ChatCompletionRequest.from_openai(openai_messages(prompt, mistral_thinks(mistral)), tools=tools)
    assert list(ids) == mistral.encode_chat_completion(request).tokens, text
    assert text == tok.decode(list(ids), skip_special_tokens=False)


def assistant_turn(mistral: Any, message: dict[str, Any]) -> list[int]:
    """mistral-common's tokens for an assistant message as the model writes it: from the end of the
    user turn (``[/INST]``) to its end-of-sequence token (left out: generation stops on it)."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    after: list[dict[str, Any]] = [{"role": "user", "content": "Thanks"}]
    if message.get("tool_calls"):
        after = [
            {"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": "ok"}
            for c in message["tool_calls"]
        ]
    request = ChatCompletionRequest.from_openai(
        [{"role": "user", "content": "Weather in Paris and Oslo?"}, message, *after],
        tools=[{"type": "function", "function": WEATHER}],
    )
    tokens = mistral.encode_chat_completion(request).tokens
    inner = mistral.instruct_tokenizer.tokenizer
    start = tokens.index(inner.get_special_token("[/INST]")) + 1
    return tokens[start : tokens.index(inner.eos_id, start)]


@pytest.mark.parametrize("version", TEKKEN_VERSIONS)
def test_mistral_calls_and_reasoning_parse_back_at_any_split(fixture_dir: Path, version: str) -> None:
    """mistral-common's own rendering of two calls (v3/v7 ``[TOOL_CALLS][{...}]``, v11 with
    ``[CALL_ID]``, v13 ``NAME[ARGS]{...}`` after a ``[THINK]`` block) through the worker's detokenizer
    and parsers in random groups of the real token ids gives back the calls and the reasoning."""
    from tests.unit.worker.test_families import parse_generated
    from worker.model.mistral_tokenizer import mistral_common_of
    from worker.prompts.mistral_prompt import mistral_thinks

    tok, profile = tekken(fixture_dir, version)
    mistral = mistral_common_of(tok)
    thinks = mistral_thinks(mistral)
    calls = [
        {"id": f"call{n}abcd", "type": "function", "function": {"name": "get_weather", "arguments": a}}
        for n, a in enumerate(('{"city": "Paris"}', '{"city": "Oslo"}'))
    ]
    message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": calls}
    answer: dict[str, Any] = {"role": "assistant", "content": "It is sunny."}
    if thinks:
        message["reasoning_content"] = answer["reasoning_content"] = "Need the weather."
    with_calls, with_answer = assistant_turn(mistral, message), assistant_turn(mistral, answer)
    reasoning = "Need the weather." if thinks else ""
    for seed in range(6):
        parsed, thought, content = parse_generated(tok, profile, with_calls, [], seed)
        assert (parsed, thought, content) == (
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})],
            reasoning,
            "",
        ), tok.decode(with_calls, skip_special_tokens=False)
        assert parse_generated(tok, profile, with_answer, [], seed)[1:] == (reasoning, "It is sunny.")


@pytest.mark.parametrize(
    "messages",
    [
        (ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello")),  # nothing to answer
        (ChatMessage("tool", "20 C", tool_call_id="call_x"),),  # a result without its call
    ],
    ids=["ends-with-the-answer", "orphan-result"],
)
def test_a_chat_mistral_common_rejects_is_a_clear_error(
    fixture_dir: Path, messages: tuple[ChatMessage, ...]
) -> None:
    from worker.errors import InvalidRequest

    tok, profile = tekken(fixture_dir, "v13")
    with pytest.raises(InvalidRequest, match="mistral-common rejected the messages") as caught:
        PromptRenderer(tok, profile).render(ChatPrompt(messages))
    assert caught.value.param == "messages"
