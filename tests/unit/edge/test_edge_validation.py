"""Request validation: each bad field → InvalidRequestError naming that field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from edge_fakes import FakeWorker, content, finished, run, running_edge, running_worker, started, usage

from edge.errors import InvalidRequestError, UnprocessableEntityError
from edge.requests.limits import RequestLimits, request_limits
from edge.settings import Settings
from edge.surfaces.completions.request import parse_completion_request
from edge.surfaces.shared.chat_request import parse_chat_request

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
        (with_(messages=[]), "messages", "empty_array"),
        (with_(tools=[]), "tools", "empty_array"),
        (with_(tool_choice="auto"), "tool_choice", "invalid_value"),
        (with_(tool_choice="none"), "tool_choice", "invalid_value"),
        (with_(max_tokens=2**31), "max_tokens", "invalid_value"),
        (with_(max_tokens=10**12), "max_tokens", "invalid_value"),
        (with_(max_completion_tokens=10**12), "max_completion_tokens", "invalid_value"),
        (with_(logit_bias={"2147483648": 1}), "logit_bias", "invalid_value"),
        (with_(logit_bias={"\u0663": 1}), "logit_bias", "invalid_value"),
        (with_(messages="hi"), "messages", "invalid_type"),
        (with_(messages=[{"role": "bot", "content": "x"}]), "messages[0].role", "invalid_value"),
        (with_(messages=[{"content": "x"}]), "messages[0].role", "missing_required_parameter"),
        (with_(messages=[{"role": "user"}]), "messages[0].content", "missing_required_parameter"),
        (with_(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_type"),
        (
            with_(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages[0].content[0].image_url.url",
            "missing_required_parameter",
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


# ------------------------------------------------------------------ operator limits

TIGHT = RequestLimits(max_messages=3, max_prompt_chars=10, max_n=2, max_tokens=50, max_top_logprobs=3)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (with_(messages=[user("a")] * 4), "messages", "at most 3 messages"),
        (with_(messages=[user("123456"), user("12345")]), "messages", "11 characters"),
        (
            with_(
                messages=[
                    user("1"),
                    {
                        "role": "assistant",
                        "reasoning_content": "23",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "4567890123"},
                            }
                        ],
                    },
                ]
            ),
            "messages",
            "13 characters",
        ),
        (with_(n=3), "n", "at most 2"),
        (with_(max_tokens=51), "max_tokens", "at most 50"),
        (with_(max_completion_tokens=51), "max_completion_tokens", "at most 50"),
        (with_(logprobs=True, top_logprobs=4), "top_logprobs", "at most 3"),
    ],
)
def test_chat_limits_name_the_field(body: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat_request(body, TIGHT)
    error = caught.value
    assert (error.http_status, error.param, error.code) == (400, param, "invalid_value")
    assert needle in error.message


def test_requests_at_the_limits_pass() -> None:
    at_limit = with_(
        messages=[user("1234"), user("5678"), user("90")], n=2, max_tokens=50, logprobs=True, top_logprobs=3
    )
    assert len(parse_chat_request(at_limit, TIGHT).messages) == 3
    completion = {"model": "m", "prompt": ["12345", "67890"], "n": 2, "max_tokens": 50, "logprobs": 3}
    assert parse_completion_request(completion, TIGHT).n == 2


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"prompt": ["123456", "12345"]}, "prompt", "11 characters"),
        ({"prompt": [[1] * 11]}, "prompt", "11 characters (or token ids)"),
        ({"prompt": "x", "n": 3}, "n", "at most 2"),
        ({"prompt": "x", "max_tokens": 51}, "max_tokens", "at most 50"),
        ({"prompt": "x", "logprobs": 4}, "logprobs", "at most 3"),
    ],
)
def test_completion_limits_name_the_field(body: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_completion_request({"model": "m", **body}, TIGHT)
    assert (caught.value.param, caught.value.code) == (param, "invalid_value")
    assert needle in caught.value.message


def test_max_tokens_limit_zero_means_no_edge_limit_and_defaults_apply_outside_requests() -> None:
    assert parse_chat_request(with_(max_tokens=10**6)).max_tokens == 10**6
    # The defaults (no context var set): 1024 messages, 128 choices.
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat_request(with_(messages=[user("a")] * 1025))
    assert caught.value.param == "messages"
    token = request_limits.set(TIGHT)
    try:
        with pytest.raises(InvalidRequestError):
            parse_chat_request(with_(n=3))  # the limits set for this context apply
    finally:
        request_limits.reset(token)
    assert parse_chat_request(with_(n=3)).n == 3


def test_limit_settings_are_validated_and_name_their_flag(capsys: pytest.CaptureFixture[str]) -> None:
    settings = Settings.from_args(
        ["--workers", "h:1", "--max-messages", "5", "--max-n", "4", "--max-tokens-limit", "100"],
        env={"SLUICE_EDGE_MAX_PROMPT_CHARS": "900", "SLUICE_EDGE_MAX_TOP_LOGPROBS": "2"},
    )
    assert settings.limits == RequestLimits(
        max_messages=5, max_prompt_chars=900, max_n=4, max_tokens=100, max_top_logprobs=2
    )
    for flag, value in (
        ("--max-messages", "0"),
        ("--max-n", "129"),
        ("--max-tokens-limit", "-1"),
        ("--max-top-logprobs", "21"),
        ("--max-prompt-chars", "lots"),
    ):
        with pytest.raises(SystemExit):
            Settings.from_args(["--workers", "h:1", flag, value], env={})
        assert flag in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_n"):
        RequestLimits(max_n=0)


def test_a_served_edge_applies_its_limits_before_calling_a_worker() -> None:
    fake = FakeWorker(script=[started(), content("ok"), finished(), usage()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], max_messages=1, max_tokens_limit=5) as base,
            httpx.AsyncClient() as client,
        ):
            url = f"{base}/v1/chat/completions"
            too_many = await client.post(url, json=with_(messages=[user("a"), user("b")]))
            assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "messages"
            too_long = await client.post(url, json=with_(max_tokens=6))
            assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
            legacy = await client.post(
                f"{base}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 9}
            )
            assert legacy.status_code == 400 and legacy.json()["error"]["param"] == "max_tokens"
            assert (await client.post(url, json=with_(max_tokens=5))).status_code == 200
        assert fake.calls_started == 1

    run(body())


# ------------------------------------------------------------ strings that are not Unicode


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (with_(model="\ud800"), "model"),
        (with_(messages=[user("ok \udfff")]), "messages[0].content"),
        (with_(stop=["a", "\ud800"]), "stop[1]"),
        (with_(user="\udc00"), "user"),
        (with_(metadata={"\ud800": "x"}), "metadata"),
        (
            with_(tools=[{"type": "function", "function": {"name": "f", "parameters": {"\ud800": {}}}}]),
            "tools[0].function.parameters",
        ),
        (with_(chat_template_kwargs={"a": ["\ud800"]}), "chat_template_kwargs.a[0]"),
    ],
)
def test_lone_surrogate_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    """JSON escapes like \\ud800 decode to strings that cannot be UTF-8 encoded (they used to be 500s)."""
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat_request(body)
    assert (caught.value.param, caught.value.code) == (param, "invalid_value")
    assert "surrogate" in caught.value.message


def test_surrogate_check_survives_the_deepest_body_json_parses() -> None:
    import json

    deep = json.loads('{"model": "m", "messages": ' + "[" * 900 + '"\\ud800"' + "]" * 900 + "}")
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat_request(deep)
    assert caught.value.param is not None and caught.value.param.startswith("messages[0][0]")
