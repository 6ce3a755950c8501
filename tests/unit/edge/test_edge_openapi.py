"""The OpenAPI document: valid 3.1, complete, generated from the models, and true to real answers."""

from __future__ import annotations

import re
from typing import Any

import pytest
from edge_fakes import content, finished, run, started, usage
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate
from pydantic.json_schema import models_json_schema

from edge.app import create_app
from edge.errors import InvalidRequestError
from edge.openapi import REF, Page, documented, openapi_document, operations
from edge.settings import Settings
from edge.surfaces.chat.translate import ChatTranslator
from edge.surfaces.completions.translate import CompletionsTranslator
from sluice.v1 import worker_pb2

APP = create_app(Settings(workers=("127.0.0.1:1",)))
DOC = openapi_document(APP)


def validator(name: str) -> Draft202012Validator:
    """A JSON Schema validator for one component (its $refs resolve inside the document)."""
    return Draft202012Validator({"$ref": REF.format(model=name), "components": DOC["components"]})


def test_document_is_valid_openapi_3_1() -> None:
    assert DOC["openapi"].startswith("3.1")
    validate(DOC)


def test_every_served_route_is_documented() -> None:
    app = create_app(Settings(workers=("127.0.0.1:1",)))
    served = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule)
        for method in rule.methods or ():
            if method not in ("HEAD", "OPTIONS"):
                served.add((path, method.lower()))
    documented = {(path, method) for path, item in DOC["paths"].items() for method in item}
    assert served == documented


def test_a_route_without_a_declared_operation_fails_the_document() -> None:
    app = create_app(Settings(workers=("127.0.0.1:1",)))

    @app.get("/undocumented")
    async def undocumented() -> str:
        return "?"

    with pytest.raises(LookupError, match="/undocumented"):
        openapi_document(app)
    documented(Page("A page", "text/plain", "Some text."))(undocumented)
    assert openapi_document(app)["paths"]["/undocumented"]["get"]["summary"] == "A page"


def test_component_schemas_are_the_pydantic_models_the_routes_declare() -> None:
    models = list(dict.fromkeys(model for _, _, operation in operations(APP) for model in operation.models()))
    _, generated = models_json_schema([(model, "validation") for model in models], ref_template=REF)
    assert DOC["components"]["schemas"] == generated["$defs"]
    for model in models:
        assert model.__name__ in DOC["components"]["schemas"]
    for path, item in DOC["paths"].items():
        if "post" in item and path.endswith("/cancel"):  # the one POST without a body
            assert "requestBody" not in item["post"], path
        elif (
            "post" in item
        ):  # every body a route takes is its request model's (JSON, or a file upload's form)
            (body,) = item["post"]["requestBody"]["content"].values()
            ref = body["schema"]["$ref"]
            assert ref.rpartition("/")[2].endswith("Request"), path
    chat = DOC["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    for status in ("400", "401", "404", "413", "422", "429", "503"):
        assert chat["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(
            "ErrorResponse"
        )
    assert "Retry-After" in chat["responses"]["429"]["headers"]
    assert "Retry-After" in chat["responses"]["503"]["headers"]


def test_request_schemas_show_the_wire_shapes() -> None:
    chat = validator("ChatCompletionRequest")
    ok = {
        "model": "m",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": "hi"},
        ],
        "stop": "x",
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    assert chat.is_valid(ok)
    assert chat.is_valid({**ok, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert not chat.is_valid({**ok, "temperature": 3})
    assert not chat.is_valid({**ok, "messages": [{"role": "bot", "content": "x"}]})
    # The rules the edge checks across fields, as far as JSON Schema can say them.
    user = {"role": "user", "content": "x"}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for bad in (
        {**ok, "tools": []},
        {**ok, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        {k: v for k, v in ok.items() if k != "tools"},  # tool_choice without tools
        {**ok, "stream": False},  # stream_options without stream
        {**ok, "top_logprobs": 2},  # without logprobs
        {**ok, "max_tokens": 2**31},
        {**ok, "messages": [{"role": "user"}]},
        {**ok, "messages": [{"role": "tool", "content": "x"}]},
        {**ok, "messages": [{"role": "assistant", "content": None}]},
        {**ok, "messages": [{"role": "user", "content": "x", "tool_calls": [call]}]},
        {**ok, "response_format": {"type": "json_schema"}},
    ):
        assert not chat.is_valid(bad), bad
    for good in (
        {**ok, "messages": [user, {"role": "assistant", "tool_calls": [call]}]},
        {**ok, "messages": [user, {"role": "tool", "content": "x", "tool_call_id": "c"}]},
        {**ok, "top_logprobs": 2, "logprobs": True},
    ):
        assert chat.is_valid(good), good
    completion = validator("CompletionRequest")
    for prompt in ("a", ["a", "b"], [1, 2], [[1], [2, 3]]):
        assert completion.is_valid({"model": "m", "prompt": prompt}), prompt
    assert not completion.is_valid({"model": "m", "prompt": "a", "logprobs": 6})
    assert completion.is_valid({"model": "m", "prompt": "a", "suffix": "b"})  # fill-in-the-middle
    assert not completion.is_valid({"model": "m", "prompt": "a", "max_tokens": 2**31})


def test_real_answers_match_the_response_schemas() -> None:
    logprob = worker_pb2.TokenLogprob(
        token="Hi", logprob=-0.5, bytes=b"Hi", top_logprobs=[worker_pb2.TopLogprob(token="Yo", logprob=-1.0)]
    )
    events = [
        started(n=2),
        worker_pb2.GenerateResponse(content=worker_pb2.ContentDelta(text="Hi", logprobs=[logprob])),
        content("x", index=1),
        finished(index=0),
        finished(index=1, reason=worker_pb2.LENGTH),
        usage(),
    ]
    builder = ChatTranslator("chatcmpl-1", 1, "m", include_usage=True, logprobs=True)
    chunks = [c for e in events for c in builder.on_event(0, e)] + builder.finish()
    continuous = ChatTranslator("chatcmpl-1", 1, "m", continuous_usage=True)
    chunks += [c for e in events for c in continuous.on_event(0, e)]
    for chunk in chunks:
        validator("ChatCompletionChunk").validate(chunk)
    accumulator = ChatTranslator("chatcmpl-1", 1, "m", logprobs=True)
    for event in events:
        accumulator.add(0, event)
    validator("ChatCompletion").validate(accumulator.result())

    text_builder = CompletionsTranslator("cmpl-1", 1, "m", n=2, logprobs=True, include_usage=True)
    text_chunks = [c for e in events for c in text_builder.on_event(0, e)] + text_builder.finish()
    for chunk in text_chunks:
        validator("TextCompletionChunk").validate(chunk)
    text = CompletionsTranslator("cmpl-1", 1, "m", n=2, logprobs=True)
    for event in events:
        text.add(0, event)
    validator("TextCompletion").validate(text.result())
    validator("ErrorResponse").validate(InvalidRequestError("x", param="n").payload())


@pytest.mark.parametrize("bad_key", ["surprise", "usage_so_far"])
def test_schemas_reject_undocumented_keys(bad_key: str) -> None:
    builder = ChatTranslator("chatcmpl-1", 1, "m")
    chunk: dict[str, Any] = builder.on_event(0, started())[0]
    assert validator("ChatCompletionChunk").is_valid(chunk)
    assert not validator("ChatCompletionChunk").is_valid({**chunk, bad_key: 1})


def test_served_at_openapi_json() -> None:
    app = create_app(Settings(workers=("127.0.0.1:1",), api_keys=("k",)))

    async def body() -> None:
        response = await app.test_client().get("/openapi.json")  # open even with keys
        assert response.status_code == 200 and response.content_type == "application/json"
        assert await response.get_json() == DOC

    run(body())
