"""/v1/completions request validation: prompt shapes, defaults, and the refused options."""

from __future__ import annotations

from typing import Any

import pytest

from edge.errors import InvalidRequestError, UnprocessableEntityError
from edge.surfaces.completions.request import MAX_PROMPTS, parse_completion_request

OK: dict[str, Any] = {"model": "m", "prompt": "Once upon a time"}


def with_(**fields: Any) -> dict[str, Any]:
    return {**OK, **fields}


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ([""], [""]),  # the worker decides about empty text (400 naming "prompt")
    ],
)
def test_prompt_shapes_become_a_list_of_prompts(prompt: Any, expected: list[Any]) -> None:
    assert parse_completion_request(with_(prompt=prompt)).prompt == expected


def test_defaults() -> None:
    request = parse_completion_request(OK)
    assert request.max_tokens == 16  # OpenAI's default for completions
    assert (request.echo, request.logprobs, request.best_of, request.suffix) == (False, None, None, None)
    assert request.choices_per_prompt == 1
    # An explicit null lifts the default: generation may run to the end of the context.
    assert parse_completion_request(with_(max_tokens=None)).max_tokens is None


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "m"}, "prompt", "missing_required_parameter"),
        ({"prompt": "x"}, "model", "missing_required_parameter"),
        (with_(prompt=[]), "prompt", "invalid_value"),
        (with_(prompt=5), "prompt", "invalid_value"),
        (with_(prompt=["a", 1]), "prompt", "invalid_value"),
        (with_(prompt=[[1], "a"]), "prompt", "invalid_value"),
        (with_(prompt=[1, -2]), "prompt", "invalid_value"),
        (with_(prompt=[True, 1]), "prompt", "invalid_value"),
        (with_(prompt=[[1], []]), "prompt", "invalid_value"),
        (with_(prompt=["x"] * (MAX_PROMPTS + 1)), "prompt", "invalid_value"),
        (with_(max_tokens=0), "max_tokens", "invalid_value"),
        (with_(max_tokens=10**12), "max_tokens", "invalid_value"),
        (with_(prompt=[2**31]), "prompt", "invalid_value"),
        (with_(prompt="\ud800"), "prompt", "invalid_value"),
        (with_(prompt=["a", "b\udfff"]), "prompt[1]", "invalid_value"),
        (with_(best_of=10**30), "best_of", "invalid_value"),
        (with_(logprobs=6), "logprobs", "invalid_value"),
        (with_(logprobs=-1), "logprobs", "invalid_value"),
        (with_(logprobs=True), "logprobs", "invalid_type"),  # the chat API's boolean, sent here by mistake
        (with_(echo="yes"), "echo", "invalid_type"),
        (with_(temperature=3), "temperature", "invalid_value"),
        (with_(n=0), "n", "invalid_value"),
        (with_(stop=[3]), "stop[0]", "invalid_type"),
        (with_(suffix="end", echo=True), "suffix", "invalid_value"),
        (with_(best_of=2), "best_of", "invalid_value"),
        (with_(best_of=1, n=2), "best_of", "invalid_value"),
        (with_(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
        (with_(logit_bias={"x": 1}), "logit_bias", "invalid_value"),
    ],
)
def test_bad_field_names_its_param(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_completion_request(body)
    assert caught.value.http_status == 400
    assert (caught.value.param, caught.value.code) == (param, code)
    assert param in caught.value.message


def test_refusals_say_why() -> None:
    with pytest.raises(InvalidRequestError) as nothing:
        parse_completion_request(with_(max_tokens=0))
    assert "echo" in nothing.value.message
    with pytest.raises(InvalidRequestError) as best_of:
        parse_completion_request(with_(best_of=3, n=2))
    assert "not supported" in best_of.value.message


def test_scoring_a_prompt_is_accepted() -> None:
    """echo + logprobs (+ max_tokens 0): what evaluation harnesses send to score a text."""
    request = parse_completion_request(with_(echo=True, logprobs=1, max_tokens=0))
    assert (request.echo, request.logprobs, request.max_tokens) == (True, 1, 0)


def test_accepted_options() -> None:
    request = parse_completion_request(
        with_(best_of=2, n=2, suffix="", echo=True, stream=True, stream_options={"include_usage": True})
    )
    assert request.best_of == 2 and request.echo and request.include_usage
    assert parse_completion_request(with_(logprobs=5)).logprobs == 5
    assert parse_completion_request(with_(stop="\n")).stop == ["\n"]


def test_non_object_body_is_422() -> None:
    with pytest.raises(UnprocessableEntityError):
        parse_completion_request(["x"])
