"""Request validation: each bad field → InvalidRequestError naming that field."""

from __future__ import annotations

from typing import Any

import pytest

from edge.errors import InvalidRequestError, UnprocessableEntityError
from edge.openai_types import parse_chat_request

OK: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOLS = [{"type": "function", "function": {"name": "w"}}]


def with_(**fields: Any) -> dict[str, Any]:
    return {**OK, **fields}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"messages": OK["messages"]}, "model", "missing_required_parameter"),
        ({"model": "m"}, "messages", "missing_required_parameter"),
        (with_(model=3), "model", "invalid_type"),
        (with_(messages=[]), "messages", "invalid_value"),
        (with_(messages="hi"), "messages", "invalid_type"),
        (with_(messages=[{"role": "bot", "content": "x"}]), "messages[0].role", "invalid_value"),
        (with_(messages=[{"content": "x"}]), "messages[0].role", "missing_required_parameter"),
        (with_(messages=[{"role": "user"}]), "messages[0].content", "missing_required_parameter"),
        (with_(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_type"),
        (
            with_(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages[0].content",
            "invalid_value",
        ),
        (with_(messages=[{"role": "assistant"}]), "messages[0].content", "missing_required_parameter"),
        (
            with_(messages=[{"role": "tool", "content": "x"}]),
            "messages[0].tool_call_id",
            "missing_required_parameter",
        ),
        (
            with_(messages=[{"role": "user", "content": "x", "tool_calls": []}, {"role": "user"}]),
            "messages[1].content",
            "missing_required_parameter",
        ),
        (with_(temperature=2.5), "temperature", "invalid_value"),
        (with_(temperature=-0.1), "temperature", "invalid_value"),
        (with_(temperature="hot"), "temperature", "invalid_type"),
        (with_(top_p=1.5), "top_p", "invalid_value"),
        (with_(n=0), "n", "invalid_value"),
        (with_(stop=[1]), "stop[0]", "invalid_type"),
        (with_(max_tokens=0), "max_tokens", "invalid_value"),
        (with_(max_completion_tokens=0), "max_completion_tokens", "invalid_value"),
        (with_(presence_penalty=3), "presence_penalty", "invalid_value"),
        (with_(frequency_penalty=-3), "frequency_penalty", "invalid_value"),
        (with_(logit_bias={"abc": 1}), "logit_bias", "invalid_value"),
        (with_(logit_bias={"5": 101}), "logit_bias", "invalid_value"),
        (with_(top_logprobs=21, logprobs=True), "top_logprobs", "invalid_value"),
        (with_(top_logprobs=2), "top_logprobs", "invalid_value"),
        (with_(stream="maybe"), "stream", "invalid_type"),
        (with_(stream_options={"include_usage": "x"}), "stream_options.include_usage", "invalid_type"),
        (
            with_(stream=True, stream_options={"continuous_usage_stats": []}),
            "stream_options.continuous_usage_stats",
            "invalid_type",
        ),
        (with_(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
        (with_(stream=False, stream_options={}), "stream_options", "invalid_value"),
        (with_(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
        (with_(function_call="auto"), "function_call", "unsupported_parameter"),
        (with_(audio={"voice": "x"}), "audio", "unsupported_parameter"),
        (with_(modalities=["text", "audio"]), "modalities", "unsupported_parameter"),
        (with_(n=129), "n", "invalid_value"),
        (with_(user=5), "user", "invalid_type"),
        (with_(parallel_tool_calls="yes"), "parallel_tool_calls", "invalid_type"),
        (with_(tools=[{"type": "function"}]), "tools[0].function", "missing_required_parameter"),
        (
            with_(tools=[{"type": "function", "function": {"name": "a b"}}]),
            "tools[0].function.name",
            "invalid_value",
        ),
        (with_(tool_choice="maybe", tools=TOOLS), "tool_choice", "invalid_value"),
        (with_(tool_choice="required"), "tool_choice", "invalid_value"),
        (
            with_(tool_choice={"type": "function", "function": {"name": "x"}}, tools=TOOLS),
            "tool_choice",
            "invalid_value",
        ),
        (with_(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
        (
            with_(response_format={"type": "json_schema"}),
            "response_format.json_schema",
            "missing_required_parameter",
        ),
        (with_(seed=2**70), "seed", "invalid_value"),
        (with_(metadata={"k": 1}), "metadata.k", "invalid_type"),
    ],
)
def test_bad_field_names_its_param(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat_request(body)
    error = caught.value
    assert error.http_status == 400
    assert error.payload()["error"]["type"] == "invalid_request_error"
    assert (error.param, error.code) == (param, code)
    assert param in error.message


@pytest.mark.parametrize(("body", "kind"), [([OK], "an array"), ("hi", "a string"), (3, "a number")])
def test_body_that_is_not_an_object_is_422(body: Any, kind: str) -> None:
    with pytest.raises(UnprocessableEntityError) as caught:
        parse_chat_request(body)
    assert caught.value.http_status == 422
    assert caught.value.payload()["error"]["type"] == "invalid_request_error"
    assert kind in caught.value.message


def test_stream_options_are_read() -> None:
    request = parse_chat_request(
        with_(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    )
    assert request.include_usage and request.continuous_usage
    plain = parse_chat_request(with_(stream=True, stream_options={}))
    assert not plain.include_usage and not plain.continuous_usage
    # Accepted and ignored: fields a text model can honour by doing nothing special.
    assert parse_chat_request(with_(modalities=["text"], store=False, service_tier="auto")).model == "m"


def test_valid_request_normalizes_unions_and_ignores_unknown_fields() -> None:
    request = parse_chat_request(
        with_(
            stop="x",
            tool_choice="auto",
            tools=TOOLS,
            something_new=1,
            messages=[
                {"role": "developer", "content": [{"type": "text", "text": "a"}]},
                {"role": "user", "content": "b", "unknown": True},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]},
            ],
        )
    )
    assert request.stop == ["x"]
    assert request.tool_choice is not None and request.tool_choice.mode == "auto"
    assert request.messages[0].content == "a"
    assert request.messages[3].content == "ok"
    assert not request.include_usage
