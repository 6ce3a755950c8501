"""Golden tests of Anthropic Messages: request → chat request, worker events → Anthropic events."""

from __future__ import annotations

from typing import Any

import pytest
from edge_fakes import content, started
from surface_fakes import counter_ids, finished_with, reasoning, tool_call, usage_with

from edge.errors import InvalidRequestError, RateLimitError, StreamIdleTimeoutError
from edge.requests.limits import RequestLimits, request_limits
from edge.surfaces.anthropic.request import parse_messages_request
from edge.surfaces.anthropic.translate import MessagesTranslator
from sluice.v1 import worker_pb2


def translator() -> MessagesTranslator:
    return MessagesTranslator("msg_1", "m", new_id=counter_ids())


def play(t: MessagesTranslator, events: list[worker_pb2.GenerateResponse]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for event in events:
        out += t.on_event(0, event)
    return out


def usage(input_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def test_text_stream_is_exact() -> None:
    t = translator()
    events = play(
        t, [started(prompt_tokens=7), content("Hi"), content("!"), finished_with(), usage_with(7, 2, 3)]
    )
    events += t.finish()
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(7, 0),
    }
    assert events == [
        {"type": "message_start", "message": message},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": usage(4, 2, cached=3),
        },
        {"type": "message_stop"},
    ]
    assert t.result() == {
        **message,
        "content": [{"type": "text", "text": "Hi!"}],
        "stop_reason": "end_turn",
        "usage": usage(4, 2, cached=3),
    }


def test_thinking_text_and_tool_use_blocks() -> None:
    t = translator()
    events = play(
        t,
        [
            started(),
            reasoning("Hmm"),
            content("Let me check."),
            tool_call(0, '{"city":', "weather", "toolu_a"),
            tool_call(0, '"Paris"}'),
            tool_call(1, "", "time"),
            finished_with(worker_pb2.TOOL_CALLS, 9),
        ],
    )
    events += t.finish()
    assert events[1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "thinking", "thinking": "", "signature": ""},
    }
    assert events[2]["delta"] == {"type": "thinking_delta", "thinking": "Hmm"}
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2, 3]
    assert starts[2]["content_block"] == {"type": "tool_use", "id": "toolu_a", "name": "weather", "input": {}}
    assert starts[3]["content_block"]["id"] == "toolu_1"  # generated when the worker gives none
    json_deltas = [
        e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"
    ]
    assert json_deltas == ['{"city":', '"Paris"}']
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2, 3]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    result = t.result()
    assert result["content"] == [
        {"type": "thinking", "thinking": "Hmm", "signature": ""},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_a", "name": "weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_1", "name": "time", "input": {}},
    ]
    assert result["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("finished", "reason", "sequence"),
    [
        (finished_with(worker_pb2.STOP), "end_turn", None),
        (finished_with(worker_pb2.STOP, matched_stop="END"), "stop_sequence", "END"),
        (finished_with(worker_pb2.LENGTH), "max_tokens", None),
        (finished_with(worker_pb2.TOOL_CALLS), "tool_use", None),
        (finished_with(worker_pb2.CONTENT_FILTER), "refusal", None),
    ],
)
def test_stop_reasons(finished: worker_pb2.GenerateResponse, reason: str, sequence: str | None) -> None:
    t = translator()
    events = play(t, [started(), content("x"), finished]) + t.finish()
    assert events[-2]["delta"] == {"stop_reason": reason, "stop_sequence": sequence}
    assert (t.result()["stop_reason"], t.result()["stop_sequence"]) == (reason, sequence)


def test_unparseable_arguments_are_kept_not_lost() -> None:
    t = translator()
    play(t, [started(), tool_call(0, "{not json", "f"), finished_with(worker_pb2.TOOL_CALLS)])
    assert t.result()["content"][0]["input"] == {"_raw_arguments": "{not json"}


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (StreamIdleTimeoutError("idle"), "timeout_error"),
        (RateLimitError("busy"), "rate_limit_error"),
        (InvalidRequestError("bad"), "invalid_request_error"),
    ],
)
def test_error_mid_stream_is_one_anthropic_error_event(error: Any, kind: str) -> None:
    t = translator()
    play(t, [started(), content("Hel")])
    assert t.on_error(error) == [{"type": "error", "error": {"type": kind, "message": error.message}}]


# ------------------------------------------------------------------ request


def parse(**fields: Any) -> Any:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse_messages_request(body)


def test_request_blocks_become_chat_messages() -> None:
    parsed = parse(
        system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Call it.", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "sunny"}],
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        stop_sequences=["END"],
        temperature=0,
        top_p=0.9,
        top_k=5,
        tools=[{"name": "weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"},
        metadata={"user_id": "u1"},
    )
    chat = parsed.chat
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be\nbrief."
    assistant = chat.messages[2]
    assert assistant.content == "Checking." and assistant.reasoning_content == "Call it."
    assert [(c.id, c.function.arguments) for c in assistant.tool_calls or ()] == [
        ("toolu_1", '{"city":"Paris"}')
    ]
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].content == "sunny"
    assert chat.max_completion_tokens == 16 and chat.stop == ["END"]
    assert chat.temperature == 0 and chat.top_p == 0.9 and chat.top_k == 5
    assert chat.tool_choice is not None and chat.tool_choice.function_name == "weather"
    assert chat.parallel_tool_calls is False and chat.reasoning_effort == "none" and chat.user == "u1"


def test_any_tool_choice_is_required_and_error_results_are_marked() -> None:
    parsed = parse(
        messages=[
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}],
            }
        ],
        tools=[{"name": "f", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any"},
    )
    assert parsed.chat.tool_choice is not None and parsed.chat.tool_choice.mode == "required"
    assert parsed.chat.messages[0].content == "Error: boom"


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"max_tokens": None}, "max_tokens", "invalid_type"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"messages": []}, "messages", "empty_array"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_value"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0].type",
            "unsupported_parameter",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].source.type",
            "missing_required_parameter",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0].tool_use_id",
            "missing_required_parameter",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}],
                    }
                ]
            },
            "messages[0].content[0].input",
            "invalid_type",
        ),
        ({"temperature": 1.5}, "temperature", "invalid_value"),
        ({"top_k": 0}, "top_k", "invalid_value"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type", "unsupported_parameter"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema", "missing_required_parameter"),
        (
            {"tool_choice": {"type": "tool"}, "tools": [{"name": "f", "input_schema": {}}]},
            "tool_choice.name",
            "unsupported_parameter",
        ),
        (
            {"tool_choice": {"type": "tool", "name": "g"}, "tools": [{"name": "f", "input_schema": {}}]},
            "tool_choice",
            "invalid_value",
        ),
        ({"system": 5}, "system", "invalid_value"),
    ],
)
def test_bad_requests_name_the_field(fields: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse(**fields)
    assert (caught.value.param, caught.value.code) == (param, code)


def test_operator_limits_apply_under_the_anthropic_names() -> None:
    token = request_limits.set(RequestLimits(max_prompt_chars=10, max_tokens=5))
    try:
        with pytest.raises(InvalidRequestError) as caught:
            parse(messages=[{"role": "user", "content": "x" * 11}])
        assert caught.value.param == "messages"
        with pytest.raises(InvalidRequestError) as caught:
            parse(max_tokens=6)
        assert caught.value.param == "max_tokens" and "'max_tokens'" in caught.value.message
    finally:
        request_limits.reset(token)
