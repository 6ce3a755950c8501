"""The OpenAPI document's schemas for the Responses, Anthropic and native surfaces match real output."""

from __future__ import annotations

from typing import Any

from edge_fakes import content, started
from jsonschema import Draft202012Validator
from surface_fakes import counter_ids, finished_with, progress, reasoning, refusal, tool_call, usage_with

from edge.app import create_app
from edge.errors import DeadlineExceededError, InvalidRequestError, NotFoundError
from edge.openapi import REF, openapi_document
from edge.requests.errors import anthropic_error, native_error_body
from edge.settings import Settings
from edge.surfaces.anthropic.translate import MessagesTranslator
from edge.surfaces.native.translate import NativeTranslator
from edge.surfaces.responses.request import parse_responses_request
from edge.surfaces.responses.translate import ResponsesTranslator
from sluice.v1 import worker_pb2

DOC = openapi_document(create_app(Settings(workers=("127.0.0.1:1",))))
EVENTS = [
    started(prompt_tokens=9),
    progress(0.5),
    reasoning("Hmm", 2),
    content("Hi"),
    refusal("no"),
    tool_call(0, '{"a":', "f", "call_1"),
    tool_call(0, "1}"),
    tool_call(1, "[", "missing"),
    finished_with(worker_pb2.TOOL_CALLS, 7, ttft=0.1, decode=0.2),
    usage_with(9, 7, cached=3, reasoning_tokens=2),
]


def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": REF.format(model=name), "components": DOC["components"]})


def played(translator: Any) -> list[dict[str, Any]]:
    return [out for event in EVENTS for out in translator.on_event(0, event)] + translator.finish()


def test_responses_events_and_body_match() -> None:
    echo = parse_responses_request(
        {
            "model": "m",
            "input": "x",
            "tools": [{"type": "function", "name": "f"}],
            "text": {"format": {"type": "json_object"}},
        }
    ).echo()
    translator = ResponsesTranslator("resp_1", 1, "m", echo, new_id=counter_ids())
    events = played(translator)
    failing = ResponsesTranslator("resp_2", 1, "m", echo, new_id=counter_ids())
    events += (
        failing.on_event(0, started())
        + failing.on_event(0, content("x"))
        + failing.on_error(DeadlineExceededError("t"))
    )
    for event in events:
        validator("ResponseStreamEvent").validate(event)
    validator("ResponseObject").validate(translator.result())
    assert not validator("ResponseStreamEvent").is_valid({**events[0], "surprise": 1})


def test_anthropic_events_body_and_errors_match() -> None:
    translator = MessagesTranslator("msg_1", "m", new_id=counter_ids())
    for event in played(translator) + translator.on_error(NotFoundError("x")):
        validator("AnthropicStreamEvent").validate(event)
    validator("AnthropicMessage").validate(translator.result())
    validator("AnthropicErrorResponse").validate(anthropic_error(InvalidRequestError("bad", param="x")))


def test_native_events_body_and_errors_match() -> None:
    translator = NativeTranslator("resp_1", "m", {"f": {"type": "object"}})
    for event in played(translator) + translator.on_error(InvalidRequestError("x", param="p")):
        validator("NativeStreamEvent").validate(event)
    validator("NativeChatResult").validate(translator.result())
    validator("NativeErrorResponse").validate(native_error_body(InvalidRequestError("bad", param="x")))


def test_request_schemas_accept_the_wire_shapes() -> None:
    assert validator("ResponsesRequest").is_valid({"model": "m", "input": [{"role": "user", "content": "x"}]})
    assert validator("MessagesRequest").is_valid(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "top_k": 3}
    )
    assert not validator("MessagesRequest").is_valid({"model": "m", "messages": []})
    assert validator("NativeChatRequest").is_valid({"model": "m", "input": "x", "reasoning": "off"})
