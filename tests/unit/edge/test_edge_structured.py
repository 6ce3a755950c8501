"""Structured outputs at the edge: every form (vLLM's structured_outputs and guided_*, llama.cpp's
grammar and json_schema) → the worker's ResponseFormat, and a 400 naming the field for two forms or
an unusable value."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge.errors import InvalidRequestError
from edge.surfaces.completions.request import parse_completion_request
from edge.surfaces.completions.translate import to_generate_requests
from edge.surfaces.shared.chat_request import parse_chat_request
from edge.surfaces.shared.structured import StructuredForm, naming_form
from edge.surfaces.shared.worker_request import to_generate_request
from sluice.v1 import worker_pb2

USER = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TAG = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}


def chat_format(**fields: Any) -> worker_pb2.ResponseFormat:
    return to_generate_request(
        parse_chat_request({"model": "m", "messages": USER, **fields}), "r"
    ).response_format


def completion_formats(**fields: Any) -> list[worker_pb2.ResponseFormat]:
    request = parse_completion_request({"model": "m", "prompt": ["a", "b"], **fields})
    return [proto.response_format for proto in to_generate_requests(request, "r")]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            worker_pb2.ResponseFormat(choice=worker_pb2.ChoiceList(choices=["yes", "no"])),
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, worker_pb2.ResponseFormat(regex="[0-9]+")),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, worker_pb2.ResponseFormat(lark='start: "a"')),
        (
            {"structured_outputs": {"json": SCHEMA}},
            worker_pb2.ResponseFormat(
                json_schema=worker_pb2.JsonSchema(
                    name="structured_outputs.json",
                    schema_json=json.dumps(SCHEMA, separators=(",", ":")),
                    strict=True,
                )
            ),
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},  # vLLM also takes the schema's JSON text
            worker_pb2.ResponseFormat(
                json_schema=worker_pb2.JsonSchema(
                    name="structured_outputs.json",
                    schema_json=json.dumps(SCHEMA, separators=(",", ":")),
                    strict=True,
                )
            ),
        ),
        (
            {"structured_outputs": {"structural_tag": json.dumps(TAG)}},
            worker_pb2.ResponseFormat(structural_tag_json=json.dumps(TAG, separators=(",", ":"))),
        ),
        (
            {"structured_outputs": {"structural_tag": TAG}},
            worker_pb2.ResponseFormat(structural_tag_json=json.dumps(TAG, separators=(",", ":"))),
        ),
        ({"structured_outputs": {"json_object": True}}, worker_pb2.ResponseFormat(json_object=True)),
        ({"guided_choice": ["x"]}, worker_pb2.ResponseFormat(choice=worker_pb2.ChoiceList(choices=["x"]))),
        ({"guided_regex": "a|b"}, worker_pb2.ResponseFormat(regex="a|b")),
        ({"guided_grammar": 'root ::= "a"'}, worker_pb2.ResponseFormat(lark='root ::= "a"')),
        ({"grammar": 'root ::= "a"'}, worker_pb2.ResponseFormat(gbnf='root ::= "a"')),
        (
            {"json_schema": SCHEMA},
            worker_pb2.ResponseFormat(
                json_schema=worker_pb2.JsonSchema(
                    name="json_schema", schema_json=json.dumps(SCHEMA, separators=(",", ":")), strict=True
                )
            ),
        ),
        # Unset fields inside structured_outputs are left alone (vLLM sends them as null).
        (
            {"structured_outputs": {"regex": "a", "choice": None, "json": None}},
            worker_pb2.ResponseFormat(regex="a"),
        ),
        # response_format of type text is no constraint, so it may stand beside a form.
        (
            {"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}},
            worker_pb2.ResponseFormat(regex="a"),
        ),
    ],
)
def test_every_form_reaches_the_worker(fields: dict[str, Any], expected: worker_pb2.ResponseFormat) -> None:
    assert chat_format(**fields) == expected
    fields.pop("response_format", None)
    assert completion_formats(**fields) == [expected, expected]  # every prompt's call


def test_response_format_alone_is_unchanged() -> None:
    assert chat_format(response_format={"type": "json_object"}) == worker_pb2.ResponseFormat(json_object=True)
    assert not to_generate_request(parse_chat_request({"model": "m", "messages": USER}), "r").HasField(
        "response_format"
    )
    assert completion_formats() == [worker_pb2.ResponseFormat(), worker_pb2.ResponseFormat()]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
            "response_format is also set",
        ),
        (
            {
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                "grammar": 'root ::= "a"',
            },
            "grammar",
            "response_format is also set",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got choice, regex"),
        ({"structured_outputs": {}}, "structured_outputs", "got none"),
        (
            {"structured_outputs": {"regex": "a"}, "guided_regex": "a"},
            "guided_regex",
            "structured_outputs.regex",
        ),
        ({"guided_json": SCHEMA, "json_schema": SCHEMA}, "json_schema", "guided_json is also set"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one string"),
        ({"guided_choice": []}, "guided_choice", "at least one string"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty"),
        ({"grammar": "  "}, "grammar", "non-empty"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "a JSON object"),
        (
            {"structured_outputs": {"structural_tag": "{"}},
            "structured_outputs.structural_tag",
            "not valid JSON",
        ),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice", ""),
        ({"structured_outputs": "regex"}, "structured_outputs", ""),
        ({"json_schema": "x"}, "json_schema", ""),
    ],
)
def test_conflicts_and_bad_values_name_the_field(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as chat:
        parse_chat_request({"model": "m", "messages": USER, **fields})
    assert chat.value.param == param and words in chat.value.message
    if "response_format" not in fields:
        with pytest.raises(InvalidRequestError) as completion:
            parse_completion_request({"model": "m", "prompt": "a", **fields})
        assert completion.value.param == param


def test_a_worker_error_about_response_format_names_the_callers_field() -> None:
    form = StructuredForm("guided_regex", worker_pb2.ResponseFormat(regex="("))
    with pytest.raises(InvalidRequestError) as info, naming_form(form):
        raise InvalidRequestError("the regular expression cannot be used", param="response_format.regex")
    assert info.value.param == "guided_regex"
    with pytest.raises(InvalidRequestError) as other, naming_form(form):
        raise InvalidRequestError("bad", param="temperature")
    assert other.value.param == "temperature"
    with pytest.raises(InvalidRequestError) as plain, naming_form(None):
        raise InvalidRequestError("bad", param="response_format.json_schema.schema")
    assert plain.value.param == "response_format.json_schema.schema"
