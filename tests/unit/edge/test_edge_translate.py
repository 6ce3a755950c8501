"""Golden tests of edge.surfaces.chat.translate: request → proto, events → exact chunk dicts."""

from __future__ import annotations

import json
from typing import Any

import pytest
from edge_fakes import content, finished, started, usage

from edge.errors import InvalidRequestError
from edge.surfaces.chat.translate import ChatTranslator
from edge.surfaces.shared.chat_request import parse_chat_request
from edge.surfaces.shared.worker_request import call_metadata, to_generate_request
from sluice.v1 import worker_pb2

USER = [{"role": "user", "content": "Hi"}]


def proto_for(**fields: Any) -> worker_pb2.GenerateRequest:
    return to_generate_request(parse_chat_request({"model": "m", "messages": USER, **fields}), "req-1")


# ------------------------------------------------------------------ request


def test_minimal_request_leaves_optional_sampling_unset() -> None:
    proto = proto_for()
    assert proto.request_id == "req-1"
    assert proto.model == "m"
    assert proto.WhichOneof("input") == "chat"
    for name in ("temperature", "top_p", "n", "seed", "max_tokens", "logprobs", "presence_penalty"):
        assert not proto.sampling.HasField(name), name
    assert not proto.HasField("response_format")
    assert not proto.chat.HasField("tool_choice")
    assert proto.chat.parallel_tool_calls is True  # OpenAI's default


def test_sampling_fields_are_translated_including_zero() -> None:
    proto = proto_for(
        temperature=0,
        top_p=0.5,
        n=2,
        stop="END",
        max_tokens=7,
        seed=-1,
        presence_penalty=-2,
        frequency_penalty=1.5,
        logit_bias={"42": -100, "7": 3},
        logprobs=True,
        top_logprobs=3,
    )
    s = proto.sampling
    assert s.HasField("temperature") and s.temperature == 0
    assert s.top_p == 0.5 and s.n == 2 and list(s.stop) == ["END"] and s.max_tokens == 7
    assert s.seed == 2**64 - 1  # int64 -1, two's complement
    assert s.presence_penalty == -2 and s.frequency_penalty == 1.5
    assert dict(s.logit_bias) == {42: -100.0, 7: 3.0}
    assert s.logprobs == 3


def test_logprobs_without_top_logprobs_asks_for_zero_alternatives() -> None:
    assert proto_for(logprobs=True).sampling.HasField("logprobs")
    assert proto_for(logprobs=True).sampling.logprobs == 0
    assert not proto_for(logprobs=False).sampling.HasField("logprobs")


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert proto_for(max_tokens=5, max_completion_tokens=9).sampling.max_tokens == 9


def test_messages_tools_and_tool_choice() -> None:
    proto = to_generate_request(
        parse_chat_request(
            {
                "model": "m",
                "messages": [
                    {
                        "role": "system",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                    {"role": "user", "content": "Weather?", "name": "ann"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "w", "arguments": '{"c":1}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                ],
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "w", "description": "weather", "parameters": {"type": "object"}},
                    }
                ],
                "tool_choice": {"type": "function", "function": {"name": "w"}},
                "parallel_tool_calls": False,
            }
        ),
        "r",
    )
    system, user, assistant, tool = proto.chat.messages
    assert (system.role, system.content) == ("system", "a\nb")
    assert (user.content, user.name) == ("Weather?", "ann")
    assert not assistant.HasField("content")
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [("call_1", "w", '{"c":1}')]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "sunny")
    (spec,) = proto.chat.tools
    assert (spec.name, spec.description, spec.parameters_json) == ("w", "weather", '{"type":"object"}')
    assert proto.chat.tool_choice.function_name == "w"
    assert proto.chat.parallel_tool_calls is False


def test_tool_choice_modes() -> None:
    tools = [{"type": "function", "function": {"name": "w"}}]
    assert (
        proto_for(tools=tools, tool_choice="required").chat.tool_choice.mode == worker_pb2.ToolChoice.REQUIRED
    )
    assert proto_for(tools=tools, tool_choice="none").chat.tool_choice.mode == worker_pb2.ToolChoice.NONE
    assert proto_for(tools=tools, tool_choice="auto").chat.tool_choice.mode == worker_pb2.ToolChoice.AUTO


def test_response_formats() -> None:
    assert proto_for(response_format={"type": "text"}).response_format.text is True
    assert proto_for(response_format={"type": "json_object"}).response_format.json_object is True
    schema = proto_for(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"a": 1}, "strict": True},
        }
    ).response_format.json_schema
    assert (schema.name, schema.schema_json, schema.strict) == ("x", '{"a":1}', True)


def test_user_and_metadata_travel_in_the_request_and_the_id_in_call_metadata() -> None:
    request = parse_chat_request({"model": "m", "messages": USER, "user": "zoë\n", "metadata": {"k": "v"}})
    proto = to_generate_request(request, "rid")
    assert proto.user == "zoë\n" and dict(proto.metadata) == {"k": "v"}
    assert call_metadata(request, "rid") == (("x-request-id", "rid"),)


# ----------------------------------------------------------------- chunks


def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 123,
        "model": "M",
        "system_fingerprint": None,
        "service_tier": None,
        "choices": choices,
        **extra,
    }


def choice(
    index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


ROLE = {"role": "assistant", "content": ""}


def play(builder: ChatTranslator, events: list[worker_pb2.GenerateResponse]) -> list[dict[str, Any]]:
    """Every chunk of a call that ended OK: each event's, then ``finish()``'s."""
    return [c for e in events for c in builder.on_event(0, e)] + builder.finish()


def test_single_choice_stream_without_usage_has_no_usage_key() -> None:
    builder = ChatTranslator("chatcmpl-x", 123, "M")
    events = [started(), content("Hel"), content("lo"), finished(), usage()]
    assert play(builder, events) == [
        chunk([choice(0, ROLE)]),
        chunk([choice(0, {"content": "Hel"})]),
        chunk([choice(0, {"content": "lo"})]),
        chunk([choice(0, {}, "stop")]),
    ]


def test_n2_role_chunks_first_in_index_order_then_usage_chunk() -> None:
    builder = ChatTranslator("chatcmpl-x", 123, "M", include_usage=True)
    events = [
        started(n=2),
        content("b", index=1),
        content("a", index=0),
        finished(index=1, reason=worker_pb2.LENGTH),
        finished(index=0),
        worker_pb2.GenerateResponse(
            usage=worker_pb2.Usage(
                prompt_tokens=5, completion_tokens=4, total_tokens=9, cached_tokens=2, reasoning_tokens=1
            )
        ),
    ]
    assert play(builder, events) == [
        chunk([choice(0, ROLE)], usage=None),
        chunk([choice(1, ROLE)], usage=None),
        chunk([choice(1, {"content": "b"})], usage=None),
        chunk([choice(0, {"content": "a"})], usage=None),
        chunk([choice(1, {}, "length")], usage=None),
        chunk([choice(0, {}, "stop")], usage=None),
        chunk(
            [],
            usage={
                "prompt_tokens": 5,
                "completion_tokens": 4,
                "total_tokens": 9,
                "prompt_tokens_details": {"cached_tokens": 2},
                "completion_tokens_details": {"reasoning_tokens": 1},
            },
        ),
    ]


def test_tool_call_deltas_carry_id_type_name_only_first() -> None:
    builder = ChatTranslator("chatcmpl-x", 123, "M")
    events = [
        started(),
        worker_pb2.GenerateResponse(
            tool_call=worker_pb2.ToolCallDelta(tool_index=0, id="call_a", name="get_weather", arguments="")
        ),
        worker_pb2.GenerateResponse(tool_call=worker_pb2.ToolCallDelta(tool_index=0, arguments='{"city":')),
        worker_pb2.GenerateResponse(tool_call=worker_pb2.ToolCallDelta(tool_index=0, arguments='"Paris"}')),
        finished(reason=worker_pb2.TOOL_CALLS),
    ]
    assert play(builder, events) == [
        chunk([choice(0, ROLE)]),
        chunk(
            [
                choice(
                    0,
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_a",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": ""},
                            }
                        ]
                    },
                )
            ]
        ),
        chunk([choice(0, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]})]),
        chunk([choice(0, {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]})]),
        chunk([choice(0, {}, "tool_calls")]),
    ]


def test_reasoning_refusal_and_progress() -> None:
    builder = ChatTranslator("chatcmpl-x", 123, "M")
    events = [
        started(),
        worker_pb2.GenerateResponse(progress=worker_pb2.Progress(stage=worker_pb2.Progress.QUEUED)),
        worker_pb2.GenerateResponse(reasoning=worker_pb2.ReasoningDelta(text="think")),
        worker_pb2.GenerateResponse(refusal=worker_pb2.RefusalDelta(text="no")),
        finished(reason=worker_pb2.CONTENT_FILTER),
    ]
    assert play(builder, events) == [
        chunk([choice(0, ROLE)]),
        chunk([choice(0, {"reasoning_content": "think"})]),
        chunk([choice(0, {"refusal": "no"})]),
        chunk([choice(0, {}, "content_filter")]),
    ]


LOGPROB_EVENT = worker_pb2.GenerateResponse(
    content=worker_pb2.ContentDelta(
        text="Hi",
        logprobs=[
            worker_pb2.TokenLogprob(
                token="Hi",
                logprob=-0.5,
                bytes=b"Hi",
                top_logprobs=[
                    worker_pb2.TopLogprob(token="Hi", logprob=-0.5, bytes=b"Hi"),
                    worker_pb2.TopLogprob(token="Yo", logprob=-1.0, bytes=b"Yo"),
                ],
            )
        ],
    )
)
LOGPROB_ENTRY = {
    "token": "Hi",
    "logprob": -0.5,
    "bytes": [72, 105],
    "top_logprobs": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
        {"token": "Yo", "logprob": -1.0, "bytes": [89, 111]},
    ],
}


def test_logprobs_in_chunks_when_asked_else_null() -> None:
    asked = ChatTranslator("chatcmpl-x", 123, "M", logprobs=True)
    assert play(asked, [started(), LOGPROB_EVENT])[1] == chunk(
        [choice(0, {"content": "Hi"}, logprobs={"content": [LOGPROB_ENTRY], "refusal": None})]
    )
    not_asked = ChatTranslator("chatcmpl-x", 123, "M")
    assert play(not_asked, [started(), LOGPROB_EVENT])[1] == chunk([choice(0, {"content": "Hi"})])


def test_delta_before_started_still_gets_its_role_chunk_first() -> None:
    builder = ChatTranslator("chatcmpl-x", 123, "M")
    assert play(builder, [content("x")]) == [chunk([choice(0, ROLE)]), chunk([choice(0, {"content": "x"})])]


# ------------------------------------------------------------ accumulator


def test_accumulator_builds_chat_completion() -> None:
    acc = ChatTranslator("chatcmpl-x", 123, "M", logprobs=True)
    for event in [
        started(n=2),
        worker_pb2.GenerateResponse(reasoning=worker_pb2.ReasoningDelta(text="hmm")),
        LOGPROB_EVENT,
        worker_pb2.GenerateResponse(
            tool_call=worker_pb2.ToolCallDelta(
                choice_index=1, tool_index=0, id="call_a", name="f", arguments="{"
            )
        ),
        worker_pb2.GenerateResponse(
            tool_call=worker_pb2.ToolCallDelta(choice_index=1, tool_index=0, arguments="}")
        ),
        finished(index=0),
        finished(index=1, reason=worker_pb2.TOOL_CALLS),
        usage(5, 3),
    ]:
        acc.add(0, event)
    assert acc.result() == {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 123,
        "model": "M",
        "system_fingerprint": None,
        "service_tier": None,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hi",
                    "refusal": None,
                    "reasoning_content": "hmm",
                },
                "logprobs": {"content": [LOGPROB_ENTRY], "refusal": None},
                "finish_reason": "stop",
            },
            {
                "index": 1,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "tool_calls": [
                        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                "logprobs": {"content": [], "refusal": None},
                "finish_reason": "tool_calls",
            },
        ],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
    }


def test_accumulator_usage_falls_back_to_started_and_finished() -> None:
    acc = ChatTranslator("chatcmpl-x", 123, "M")
    for event in [started(prompt_tokens=4), content("a"), finished(tokens=6)]:
        acc.add(0, event)
    result = acc.result()
    assert result["usage"]["prompt_tokens"] == 4
    assert result["usage"]["completion_tokens"] == 6
    assert result["usage"]["total_tokens"] == 10
    assert result["choices"][0]["logprobs"] is None


# ------------------------------------------------------- continuous usage


def test_token_ids_are_asked_only_for_streamed_continuous_usage() -> None:
    assert not proto_for().return_token_ids
    assert not proto_for(stream=True, stream_options={"include_usage": True}).return_token_ids
    assert proto_for(stream=True, stream_options={"continuous_usage_stats": True}).return_token_ids


def running(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def test_continuous_usage_on_every_chunk_and_the_total_last() -> None:
    builder = ChatTranslator("chatcmpl-x", 123, "M", include_usage=True, continuous_usage=True)
    events = [
        started(n=2, prompt_tokens=5),
        content("Hel", index=0, token_ids=(1, 2)),
        content("X", index=1, token_ids=(3,)),
        finished(index=1, tokens=2),  # one more token than seen: EOS
        content("lo", index=0, token_ids=(4,)),
        finished(index=0, tokens=3),
        usage(prompt=5, completion=5),
    ]
    assert play(builder, events) == [
        chunk([choice(0, ROLE)], usage=running(5, 0)),
        chunk([choice(1, ROLE)], usage=running(5, 0)),
        chunk([choice(0, {"content": "Hel"})], usage=running(5, 2)),
        chunk([choice(1, {"content": "X"})], usage=running(5, 3)),
        chunk([choice(1, {}, "stop")], usage=running(5, 4)),
        chunk([choice(0, {"content": "lo"})], usage=running(5, 5)),
        chunk([choice(0, {}, "stop")], usage=running(5, 5)),
        chunk([], usage=running(5, 5)),
    ]


def test_continuous_usage_without_include_usage_has_no_final_chunk() -> None:
    builder = ChatTranslator("chatcmpl-x", 123, "M", continuous_usage=True)
    chunks = play(
        builder, [started(prompt_tokens=2), content("a", token_ids=(9,)), finished(tokens=1), usage()]
    )
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 1]
    assert all(c["choices"] for c in chunks)


def test_thinking_switches_reach_the_worker() -> None:
    off = to_generate_request(
        parse_chat_request({"model": "m", "messages": USER, "reasoning_effort": "none"}), "r"
    )
    assert off.chat.HasField("enable_thinking") and off.chat.enable_thinking is False
    body = {
        "model": "m",
        "messages": USER,
        "chat_template_kwargs": {"enable_thinking": True, "style": "terse"},
    }
    on = to_generate_request(parse_chat_request(body), "r")
    assert on.chat.enable_thinking is True and json.loads(on.chat.chat_template_kwargs_json) == {
        "style": "terse"
    }
    default = to_generate_request(parse_chat_request({"model": "m", "messages": USER}), "r")
    assert not default.chat.HasField("enable_thinking") and not default.chat.chat_template_kwargs_json


def test_thinking_budgets_and_efforts_reach_the_worker_from_every_surface() -> None:
    from edge.surfaces.anthropic.request import parse_messages_request
    from edge.surfaces.native.request import parse_native_request
    from edge.surfaces.responses.request import parse_responses_request

    chat = to_generate_request(
        parse_chat_request(
            {"model": "m", "messages": USER, "thinking_token_budget": 64, "reasoning_effort": "low"}
        ),
        "r",
    ).chat
    assert chat.thinking_token_budget == 64 and chat.reasoning_effort == "low"
    assert not chat.HasField("enable_thinking")
    plain = to_generate_request(parse_chat_request({"model": "m", "messages": USER}), "r").chat
    assert not plain.HasField("thinking_token_budget") and plain.reasoning_effort == ""
    messages = parse_messages_request(
        {
            "model": "m",
            "max_tokens": 16,
            "messages": USER,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }
    )
    assert to_generate_request(messages.chat, "r").chat.thinking_token_budget == 1024
    responses = parse_responses_request({"model": "m", "input": "Hi", "reasoning": {"effort": "xhigh"}})
    assert to_generate_request(responses.chat, "r").chat.reasoning_effort == "high"
    native = to_generate_request(
        parse_native_request({"model": "m", "input": "Hi", "reasoning": "medium"}).chat, "r"
    )
    assert native.chat.reasoning_effort == "medium" and native.chat.enable_thinking is True
    with pytest.raises(InvalidRequestError) as refused:
        parse_chat_request({"model": "m", "messages": USER, "thinking_token_budget": -1})
    assert refused.value.param == "thinking_token_budget"
