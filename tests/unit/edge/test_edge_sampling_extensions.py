"""vLLM's sampling extensions on every surface (honoured or refused, never dropped), and
``--strict-fields`` (a body field no request model knows is a 400 naming it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from edge.app import create_app
from edge.errors import InvalidRequestError
from edge.openapi import REF, openapi_document
from edge.requests.models import strict_fields
from edge.settings import Settings
from edge.surfaces.anthropic.request import parse_messages_request
from edge.surfaces.completions.request import parse_completion_request
from edge.surfaces.completions.translate import to_generate_requests
from edge.surfaces.native.request import parse_native_request
from edge.surfaces.responses.request import parse_responses_request
from edge.surfaces.shared.chat_request import parse_chat_request
from edge.surfaces.shared.worker_request import to_generate_request
from sluice.v1 import worker_pb2

EXTENSIONS: dict[str, Any] = {
    "top_k": 1,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "stop_token_ids": [2, 7],
    "bad_words": ["Paris", "big dog"],
    "allowed_token_ids": [5, 6, 9],
    "skip_special_tokens": False,
    "include_stop_str_in_output": True,
    "truncate_prompt_tokens": 64,
    "ignore_eos": True,
    "min_tokens": 2,
    "speculative": False,
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "m", "prompt": "Hi"}


def check_sampling(sampling: worker_pb2.SamplingParams) -> None:
    assert sampling.top_k == 1 and sampling.min_p == pytest.approx(0.05)
    assert sampling.repetition_penalty == pytest.approx(1.1)
    assert list(sampling.stop_token_ids) == [2, 7] and list(sampling.bad_words) == ["Paris", "big dog"]
    assert list(sampling.allowed_token_ids) == [5, 6, 9]
    assert sampling.HasField("skip_special_tokens") and not sampling.skip_special_tokens
    assert sampling.include_stop_str_in_output and sampling.truncate_prompt_tokens == 64
    assert sampling.ignore_eos and sampling.min_tokens == 2
    assert sampling.HasField("speculative") and not sampling.speculative


def test_chat_passes_every_extension_to_the_worker() -> None:
    check_sampling(to_generate_request(parse_chat_request({**CHAT, **EXTENSIONS}), "r").sampling)


def test_completions_pass_every_extension_to_the_worker() -> None:
    request = parse_completion_request({**COMPLETION, **EXTENSIONS})
    (proto,) = to_generate_requests(request, "r")
    check_sampling(proto.sampling)


def test_unset_extensions_stay_unset() -> None:
    sampling = to_generate_request(parse_chat_request(CHAT), "r").sampling
    for name in (
        "top_k",
        "min_p",
        "repetition_penalty",
        "skip_special_tokens",
        "truncate_prompt_tokens",
        "speculative",
    ):
        assert not sampling.HasField(name), name
    assert not (sampling.stop_token_ids or sampling.bad_words or sampling.allowed_token_ids)
    assert not sampling.include_stop_str_in_output


@pytest.mark.parametrize(
    "parse",
    [
        lambda extra: parse_responses_request({"model": "m", "input": "Hi", **extra}),
        lambda extra: parse_messages_request(
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], **extra}
        ),
        lambda extra: parse_native_request({"model": "m", "input": "Hi", **extra}),
    ],
    ids=["responses", "anthropic", "native"],
)
def test_rewritten_surfaces_pass_every_extension_too(parse: Any) -> None:
    check_sampling(to_generate_request(parse(EXTENSIONS).chat, "r").sampling)


def test_native_repeat_penalty_is_repetition_penalty() -> None:
    parsed = parse_native_request({"model": "m", "input": "Hi", "repeat_penalty": 1.3})
    assert to_generate_request(parsed.chat, "r").sampling.repetition_penalty == pytest.approx(1.3)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 11}, "repetition_penalty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"bad_words": ["ok", "  "]}, "bad_words[1]"),
        ({"bad_words": "Paris"}, "bad_words"),
        ({"bad_words": ["w"] * 257}, "bad_words"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, 2**31]}, "allowed_token_ids[1]"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"speculative": "off"}, "speculative"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
@pytest.mark.parametrize("base", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_out_of_range_extensions_name_the_field(
    base: dict[str, Any], fields: dict[str, Any], param: str
) -> None:
    parse = parse_chat_request if "messages" in base else parse_completion_request
    with pytest.raises(InvalidRequestError) as caught:
        parse({**base, **fields})
    assert caught.value.param == param and caught.value.http_status == 400


@pytest.fixture
def strict() -> Iterator[None]:
    token = strict_fields.set(True)
    yield
    strict_fields.reset(token)


def test_unknown_fields_are_ignored_by_default() -> None:
    parse_chat_request({**CHAT, "top-k": 3, "messages": [{"role": "user", "content": "x", "foo": 1}]})
    parse_completion_request({**COMPLETION, "use_beam_search": True})


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (parse_chat_request, {**CHAT, "top-k": 3}, "top-k"),
        (
            parse_chat_request,
            {**CHAT, "messages": [{"role": "user", "content": "x", "foo": 1}]},
            "messages[0].foo",
        ),
        (
            parse_chat_request,
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "strictly": True}}]},
            "tools[0].function.strictly",
        ),
        (parse_completion_request, {**COMPLETION, "use_beam_search": True}, "use_beam_search"),
        (parse_responses_request, {"model": "m", "input": "x", "include": ["a"]}, "include"),
        (
            parse_responses_request,
            {"model": "m", "input": [{"role": "user", "content": "x", "phase": 1}]},
            "input[0].phase",
        ),
        (
            parse_messages_request,
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "top_n": 3},
            "top_n",
        ),
        (parse_native_request, {"model": "m", "input": "x", "typical_p": 0.5}, "typical_p"),
    ],
)
def test_strict_fields_refuse_an_unknown_field_by_name(
    strict: None, parse: Any, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse(body)
    error = caught.value
    assert error.param == param and error.code == "unknown_parameter" and param in error.message


def test_strict_fields_accept_the_documented_no_ops_and_every_extension(strict: None) -> None:
    parse_chat_request(
        {**CHAT, **EXTENSIONS, "store": False, "service_tier": "auto", "prompt_cache_key": "k"}
    )
    parse_completion_request({**COMPLETION, **EXTENSIONS, "safety_identifier": "u"})
    parse_responses_request(
        {
            "model": "m",
            "input": [
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "a", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "status": "completed",
                    "call_id": "c",
                    "name": "f",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "c", "output": "1"},
            ],
        }
    )
    parse_messages_request(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}],
            "tools": [
                {"type": "custom", "name": "f", "input_schema": {"type": "object"}, "cache_control": {}}
            ],
        }
    )


def test_strict_fields_still_give_the_refused_chat_fields_their_own_error(strict: None) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat_request({**CHAT, "functions": [{"name": "f"}]})
    assert caught.value.param == "functions" and caught.value.code == "unsupported_parameter"


@pytest.mark.parametrize("name", ["ChatCompletionRequest", "CompletionRequest"])
def test_the_openapi_document_lists_the_extensions(name: str) -> None:
    document = openapi_document(create_app(Settings(workers=("127.0.0.1:1",))))
    schema = document["components"]["schemas"][name]["properties"]
    for field in EXTENSIONS:
        assert field in schema, field
    validator = Draft202012Validator({"$ref": REF.format(model=name), "components": document["components"]})
    base = CHAT if "Chat" in name else COMPLETION
    assert validator.is_valid({**base, **EXTENSIONS})
    for bad in (
        {"top_k": -2},
        {"truncate_prompt_tokens": 0},
        {"bad_words": [" "]},
        {"allowed_token_ids": []},
    ):
        assert not validator.is_valid({**base, **bad}), bad
