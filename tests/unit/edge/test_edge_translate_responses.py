"""Golden tests of the Responses API: request → chat request, worker events → typed events."""

from __future__ import annotations

from typing import Any

import pytest
from edge_fakes import content, started
from surface_fakes import counter_ids, finished_with, reasoning, refusal, tool_call, usage_with

from edge.errors import DeadlineExceededError, InvalidRequestError
from edge.requests.limits import RequestLimits, request_limits
from edge.surfaces.responses.request import parse_responses_request
from edge.surfaces.responses.translate import ResponsesTranslator
from sluice.v1 import worker_pb2

ECHO = {"instructions": None, "tools": []}


def translator() -> ResponsesTranslator:
    return ResponsesTranslator("resp_1", 100, "m", dict(ECHO), new_id=counter_ids())


def play(t: ResponsesTranslator, events: list[worker_pb2.GenerateResponse]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for event in events:
        out += t.on_event(0, event)
    return out


def response(status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 100,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "model": "m",
        "output": output,
        "previous_response_id": None,
        "store": False,
        "truncation": "disabled",
        "usage": usage,
        **ECHO,
    }


TEXT_PART = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def test_text_stream_is_exact() -> None:
    t = translator()
    events = play(
        t, [started(prompt_tokens=7), content("Hi"), content("!"), finished_with(), usage_with(7, 2)]
    )
    events += t.finish()
    message_done = {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{**TEXT_PART, "text": "Hi!"}],
    }
    usage = {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 9,
    }
    ids = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    expected = [
        {"type": "response.created", "response": response("in_progress", [], None)},
        {"type": "response.in_progress", "response": response("in_progress", [], None)},
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**message_done, "status": "in_progress", "content": []},
        },
        {"type": "response.content_part.added", **ids, "part": TEXT_PART},
        {"type": "response.output_text.delta", **ids, "delta": "Hi", "logprobs": []},
        {"type": "response.output_text.delta", **ids, "delta": "!", "logprobs": []},
        {"type": "response.output_text.done", **ids, "text": "Hi!", "logprobs": []},
        {"type": "response.content_part.done", **ids, "part": {**TEXT_PART, "text": "Hi!"}},
        {"type": "response.output_item.done", "output_index": 0, "item": message_done},
        {"type": "response.completed", "response": response("completed", [message_done], usage)},
    ]
    assert events == [{**e, "sequence_number": i} | e for i, e in enumerate(expected)]
    assert [e["sequence_number"] for e in events] == list(range(len(expected)))
    assert t.result() == events[-1]["response"]


def test_reasoning_then_text_then_two_tool_calls() -> None:
    t = translator()
    events = play(
        t,
        [
            started(prompt_tokens=7),
            reasoning("Think", 2),
            reasoning("ing"),
            content("Hi"),
            tool_call(0, '{"a"', "f", "call_x"),
            tool_call(0, ":1}"),
            tool_call(1, "{}", "g"),
            finished_with(worker_pb2.TOOL_CALLS, 5),
            usage_with(7, 5, cached=2, reasoning_tokens=3),
        ],
    )
    events += t.finish()
    kinds = [e["type"] for e in events]
    assert kinds[2:9] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert events[5]["delta"] == "ing" and events[6]["text"] == "Thinking"
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    args = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"], e["output_index"]) for e in args] == [
        ("f", '{"a":1}', 2),
        ("g", "{}", 3),
    ]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == "completed"
    assert [item["type"] for item in final["output"]] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert final["output"][2] == {
        "type": "function_call",
        "id": "fc_3",
        "call_id": "call_x",
        "name": "f",
        "arguments": '{"a":1}',
        "status": "completed",
    }
    assert final["output"][3]["call_id"] == "call_5"  # generated when the worker gives none
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 2
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


def test_refusal_is_a_refusal_part_of_the_message() -> None:
    t = translator()
    events = play(t, [started(), refusal("No."), finished_with(worker_pb2.CONTENT_FILTER)]) + t.finish()
    kinds = [e["type"] for e in events]
    assert "response.refusal.delta" in kinds and "response.refusal.done" in kinds
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "content_filter"}
    assert final["output"][0]["content"] == [{"type": "refusal", "refusal": "No."}]


def test_max_output_tokens_ends_incomplete() -> None:
    t = translator()
    events = play(t, [started(), content("Hel"), finished_with(worker_pb2.LENGTH, 1)]) + t.finish()
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_error_mid_stream_is_error_then_response_failed() -> None:
    t = translator()
    events = play(t, [started(), content("Hel")])
    events += t.on_error(DeadlineExceededError("The request timed out."))
    assert [e["type"] for e in events[-4:]] == [
        "response.content_part.done",
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    error = events[-2]
    assert error == {
        "type": "error",
        "sequence_number": error["sequence_number"],
        "code": "timeout",
        "message": "The request timed out.",
        "param": None,
    }
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "timeout", "message": "The request timed out."}
    assert failed["output"][0]["content"][0]["text"] == "Hel"
    assert failed["output"][0]["status"] == "incomplete"


# ------------------------------------------------------------------ request


def parse(**fields: Any) -> Any:
    return parse_responses_request({"model": "m", "input": "Hi", **fields})


def test_request_items_become_chat_messages() -> None:
    parsed = parse(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        ],
        tools=[{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "w"},
        max_output_tokens=9,
        temperature=0,
        top_p=0.5,
        text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
    )
    chat = parsed.chat
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert [c.id for c in chat.messages[2].tool_calls or ()] == ["c1", "c2"]
    assert chat.messages[3].tool_call_id == "c1" and chat.messages[3].content == "sunny"
    assert chat.max_completion_tokens == 9 and chat.temperature == 0 and chat.top_p == 0.5
    assert chat.tool_choice is not None and chat.tool_choice.function_name == "w"
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    echo = parsed.echo()
    assert echo["tool_choice"] == {"type": "function", "name": "w"}
    assert echo["text"]["format"]["type"] == "json_schema"
    assert echo["tools"][0]["name"] == "w"


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"conversation": 5}, "conversation", "invalid_value"),
        ({"conversation": {"id": 5}}, "conversation", "invalid_value"),
        ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation", "invalid_value"),
        ({"background": True, "store": False}, "background", "invalid_value"),
        ({"input": 5}, "input", "invalid_value"),
        ({"input": []}, "input", "invalid_value"),
        (
            {"input": [{"type": "function_call_output", "output": "x"}]},
            "input[0].call_id",
            "missing_required_parameter",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
            "unsupported_parameter",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].image_url",
            "missing_required_parameter",
        ),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", "invalid_value"),
        ({"tool_choice": "maybe"}, "tool_choice", "invalid_value"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "invalid_value"),
        ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"temperature": 3}, "temperature", "invalid_value"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema",
            "missing_required_parameter",
        ),
        ({"stream": "yes"}, "stream", "invalid_type"),
    ],
)
def test_bad_requests_name_the_field(fields: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse(**fields)
    assert (caught.value.param, caught.value.code) == (param, code)
    assert caught.value.http_status == 400


def test_operator_limits_apply_under_the_responses_names() -> None:
    token = request_limits.set(RequestLimits(max_messages=2, max_prompt_chars=10, max_tokens=5))
    try:
        for fields, param in (
            ({"input": "x" * 11}, "input"),
            ({"instructions": "a", "input": [{"role": "user", "content": "b"}] * 2}, "input"),
            ({"max_output_tokens": 6}, "max_output_tokens"),
        ):
            with pytest.raises(InvalidRequestError) as caught:
                parse(**fields)
            assert caught.value.param == param
            assert f"'{param}'" in caught.value.message
    finally:
        request_limits.reset(token)
