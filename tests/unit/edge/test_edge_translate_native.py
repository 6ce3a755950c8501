"""Golden tests of the native event stream (/api/v1/chat): request → chat, events → named events."""

from __future__ import annotations

from typing import Any

import pytest
from edge_fakes import content, started
from surface_fakes import finished_with, progress, reasoning, tool_call, usage_with

from edge.errors import InternalError, InvalidRequestError
from edge.surfaces.native.request import parse_native_request
from edge.surfaces.native.translate import NativeTranslator, schema_errors
from edge.surfaces.shared.worker_request import to_generate_request
from sluice.v1 import worker_pb2

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}


def translator() -> NativeTranslator:
    return NativeTranslator("resp_1", "m", {"weather": WEATHER, "free": None})


def play(t: NativeTranslator, events: list[worker_pb2.GenerateResponse]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for event in events:
        out += t.on_event(0, event)
    return out


def test_text_stream_is_exact() -> None:
    t = translator()
    events = play(
        t,
        [
            started(prompt_tokens=40),
            progress(0.5),
            progress(1.0),
            content("Hi"),
            content("!"),
            finished_with(tokens=3, ttft=0.25, decode=0.5),
            usage_with(40, 3),
        ],
    )
    events += t.finish()
    result = {
        "model_instance_id": "m",
        "output": [{"type": "message", "content": "Hi!"}],
        "stats": {
            "input_tokens": 40,
            "total_output_tokens": 3,
            "reasoning_output_tokens": 0,
            "tokens_per_second": 4.0,
            "time_to_first_token_seconds": 0.25,
        },
        "stop_reason": "stop",
        "response_id": "resp_1",
    }
    assert events == [
        {"type": "chat.start", "model_instance_id": "m"},
        {"type": "prompt_processing.start"},
        {"type": "prompt_processing.progress", "progress": 0.5},
        {"type": "prompt_processing.progress", "progress": 1.0},
        {"type": "prompt_processing.end"},
        {"type": "message.start"},
        {"type": "message.delta", "content": "Hi"},
        {"type": "message.delta", "content": "!"},
        {"type": "message.end"},
        {"type": "chat.end", "result": result},
    ]
    assert t.result() == result


def test_reasoning_tool_calls_and_failures_in_order() -> None:
    t = translator()
    events = play(
        t,
        [
            started(),
            reasoning("Need weather", 4),
            tool_call(0, '{"city":', "weather"),
            tool_call(0, '"Paris"}'),
            tool_call(1, "{}", "open_browser"),
            tool_call(2, '{"days": 2}', "weather"),
            tool_call(3, "[1]", "free"),
            tool_call(4, '{"x": 1}', "free"),
            content("Done"),
            finished_with(worker_pb2.STOP, 20),
            usage_with(5, 20, reasoning_tokens=4),
        ],
    )
    events += t.finish()
    kinds = [e["type"] for e in events]
    assert kinds == [
        "chat.start",
        "prompt_processing.start",
        "prompt_processing.end",
        "reasoning.start",
        "reasoning.delta",
        "reasoning.end",
        "tool_call.start",
        "tool_call.arguments",
        "tool_call.start",
        "tool_call.failure",
        "tool_call.start",
        "tool_call.failure",
        "tool_call.start",
        "tool_call.failure",
        "tool_call.start",
        "tool_call.arguments",
        "message.start",
        "message.delta",
        "message.end",
        "chat.end",
    ]
    assert events[6] == {"type": "tool_call.start", "tool": "weather"}
    assert events[7] == {"type": "tool_call.arguments", "tool": "weather", "arguments": {"city": "Paris"}}
    assert events[9] == {
        "type": "tool_call.failure",
        "reason": "Cannot find tool with name open_browser.",
        "metadata": {"type": "invalid_name", "tool_name": "open_browser"},
    }
    assert events[11]["metadata"] == {
        "type": "invalid_arguments",
        "tool_name": "weather",
        "arguments": {"days": 2},
    }
    assert "arguments.city is required" in events[11]["reason"]
    assert events[13]["metadata"] == {"type": "invalid_arguments", "tool_name": "free"}  # not an object
    result = events[-1]["result"]
    assert [item["type"] for item in result["output"]] == [
        "reasoning",
        "tool_call",
        "invalid_tool_call",
        "invalid_tool_call",
        "invalid_tool_call",
        "tool_call",
        "message",
    ]
    assert result["output"][0] == {"type": "reasoning", "content": "Need weather"}
    assert result["stats"]["reasoning_output_tokens"] == 4


def test_model_load_progress_is_framed() -> None:
    t = translator()
    events = play(
        t,
        [
            started(),
            progress(0.25, worker_pb2.Progress.MODEL_LOAD),
            progress(1.0, worker_pb2.Progress.MODEL_LOAD),
            content("x"),
        ],
    )
    assert [e["type"] for e in events[2:6]] == [
        "model_load.start",
        "model_load.progress",
        "model_load.progress",
        "model_load.end",
    ]


def test_a_model_load_before_the_start_is_exact() -> None:
    # A request that arrived while the worker was still loading: the load, then the chat,
    # whose model id is the worker's (the request named none).
    t = NativeTranslator("resp_1", "", {})
    events = play(
        t,
        [
            progress(0.05, worker_pb2.Progress.MODEL_LOAD),
            progress(0.7, worker_pb2.Progress.MODEL_LOAD),
            started(model="m"),
            content("x"),
        ],
    )
    assert events == [
        {"type": "model_load.start", "model_instance_id": ""},
        {"type": "model_load.progress", "model_instance_id": "", "progress": 0.05},
        {"type": "model_load.progress", "model_instance_id": "", "progress": 0.7},
        {"type": "model_load.end", "model_instance_id": ""},
        {"type": "chat.start", "model_instance_id": "m"},
        {"type": "prompt_processing.start"},
        {"type": "prompt_processing.end"},
        {"type": "message.start"},
        {"type": "message.delta", "content": "x"},
    ]
    assert t.finish()[-1]["result"]["model_instance_id"] == "m"


def test_error_then_chat_end_with_partial_result() -> None:
    t = translator()
    events = play(t, [started(), content("Hel")])
    events += t.on_error(InternalError("The server had an error while processing your request."))
    assert events[-3:] == [
        {"type": "message.end"},
        {
            "type": "error",
            "error": {
                "type": "internal_error",
                "message": "The server had an error while processing your request.",
                "code": "internal_error",
                "param": None,
            },
        },
        {"type": "chat.end", "result": t.result()},
    ]
    assert events[-1]["result"]["output"] == [{"type": "message", "content": "Hel"}]


def test_schema_errors_cover_the_common_keywords() -> None:
    assert schema_errors({"city": "P"}, WEATHER) == []
    assert schema_errors({"city": 1, "x": 2}, WEATHER) == [
        "arguments.city must be of type string",
        "arguments.x is not an allowed property",
    ]
    assert schema_errors({"city": "P", "days": True}, WEATHER) == ["arguments.days must be of type integer"]
    assert schema_errors(["a"], {"type": "array", "items": {"enum": ["b"]}}) == [
        "arguments[0] must be one of ['b']"
    ]


# ------------------------------------------------------------------ request


def parse(**fields: Any) -> Any:
    return parse_native_request({"model": "m", "input": "Hi", **fields})


def test_request_fields_reach_the_chat_request_and_the_proto() -> None:
    parsed = parse(
        input=[
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
        system_prompt="Be brief.",
        temperature=0,
        top_k=3,
        min_p=0.1,
        repeat_penalty=1.2,
        max_output_tokens=7,
        tools=[{"type": "function", "name": "weather", "parameters": WEATHER}],
        tool_choice={"type": "function", "name": "weather"},
        reasoning="off",
    )
    chat = parsed.chat
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert chat.tool_choice is not None and chat.tool_choice.function_name == "weather"
    proto = to_generate_request(chat, "r1")
    assert proto.sampling.top_k == 3 and proto.sampling.repetition_penalty == pytest.approx(1.2)
    assert proto.sampling.min_p == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": None}, "model"),
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"tools": [{"type": "mcp"}]}, "tools[0].type"),
        ({"reasoning": "maybe"}, "reasoning"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"repeat_penalty": 1.1, "repetition_penalty": 1.2}, "repeat_penalty"),
        ({"bad_words": [""]}, "bad_words[0]"),
    ],
)
def test_bad_requests_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse(**fields)
    assert caught.value.param == param
