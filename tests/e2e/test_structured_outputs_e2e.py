"""Structured outputs in every form through the openai SDK's ``extra_body``, against a real edge and
worker serving the default model: vLLM's ``structured_outputs`` (choice, regex, Lark grammar, json,
structural_tag) and ``guided_*``, llama.cpp's ``grammar`` (GBNF); sampled at temperature 1, streamed
and not, chat and completions, n > 1; a grammar that cannot compile is a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Answer briefly: is the sky blue?"}]
N = 5


@pytest.fixture(scope="module")
def client(default_edge) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_edge.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


# Every constraint below allows at most 26 bytes of output: a token holds at least one byte, so
# max_tokens 32 always leaves room for the whole output and its end (finish_reason "stop").


def chat_texts(
    client: openai.OpenAI, extra: dict[str, Any], *, stream: bool, n: int = N, **kw: Any
) -> list[str]:
    """The n choices' texts of one chat request; every choice must end by itself (``stop``)."""
    args: dict[str, Any] = {"model": MODEL, "messages": ASK, "temperature": 1, "n": n, "extra_body": extra}
    args |= {"max_tokens": 32} | kw
    if not stream:
        answer = client.chat.completions.create(**args)
        assert [c.finish_reason for c in answer.choices] == ["stop"] * n
        return [c.message.content or "" for c in sorted(answer.choices, key=lambda c: c.index)]
    texts, finishes = [""] * n, [None] * n
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert finishes == ["stop"] * n
    return texts


def completion_texts(client: openai.OpenAI, extra: dict[str, Any], *, stream: bool, n: int = N) -> list[str]:
    """The n choices' texts of one text completion; every choice must end by itself."""
    args: dict[str, Any] = {
        "model": MODEL,
        "prompt": "Q: Is the sky blue?\nA:",
        "temperature": 1,
        "n": n,
        "max_tokens": 32,
        "extra_body": extra,
    }
    if not stream:
        answer = client.completions.create(**args)
        assert [c.finish_reason for c in answer.choices] == ["stop"] * n
        return [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    texts, finishes = [""] * n, [None] * n
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert finishes == ["stop"] * n
    return texts


def twenty(client: openai.OpenAI, extra: dict[str, Any]) -> list[str]:
    """20 sampled outputs: 4 requests of n = 5 (chat and completions, each streamed and not)."""
    return [
        *chat_texts(client, extra, stream=False),
        *chat_texts(client, extra, stream=True),
        *completion_texts(client, extra, stream=False),
        *completion_texts(client, extra, stream=True),
    ]


def test_choice_outputs_are_always_one_of_the_choices(client):
    choices = ["yes", "no", "not sure"]
    outputs = twenty(client, {"structured_outputs": {"choice": choices}})
    assert len(outputs) == 20 and set(outputs) <= set(choices)


def test_regex_outputs_always_fullmatch(client):
    pattern = r"(yes|no), [0-9]{1,3} (percent|times)"
    outputs = twenty(client, {"structured_outputs": {"regex": pattern}})
    assert len(outputs) == 20
    for text in outputs:
        assert re.fullmatch(pattern, text), text


def test_lark_grammar_outputs_always_parse(client):
    lark = 'start: answer " because " reason "."\nanswer: "Yes" | "No"\nreason: /[a-z]{1,6}( [a-z]{1,6})?/\n'
    outputs = twenty(client, {"structured_outputs": {"grammar": lark}})
    assert len(outputs) == 20
    for text in outputs:
        assert re.fullmatch(r"(Yes|No) because [a-z]{1,6}( [a-z]{1,6})?\.", text), text


def test_older_guided_fields_and_gbnf(client):
    for text in chat_texts(client, {"guided_regex": "[A-Z][a-z]{2,5}!"}, stream=False, n=3):
        assert re.fullmatch("[A-Z][a-z]{2,5}!", text), text
    gbnf = 'root ::= verdict " (" [0-9] "/10)"\nverdict ::= "good" | "bad"\n'
    for text in chat_texts(client, {"grammar": gbnf}, stream=True, n=3):  # llama.cpp's field
        assert re.fullmatch(r"(good|bad) \([0-9]/10\)", text), text
    for text in completion_texts(client, {"guided_choice": ["up", "down"]}, stream=False, n=3):
        assert text in ("up", "down")


SCHEMA = {
    "type": "object",
    "properties": {"blue": {"type": "boolean"}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["blue", "score"],
    "additionalProperties": False,
}


def test_json_form_parses_against_its_schema(client):
    outputs = chat_texts(client, {"structured_outputs": {"json": SCHEMA}}, stream=False, n=3)
    outputs += chat_texts(client, {"guided_json": json.dumps(SCHEMA)}, stream=True, n=2)
    for text in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_structural_tag_constrains_what_follows_a_trigger(client, tokenizer):
    """logit_bias makes "@" (the trigger, one token) the likeliest token everywhere, so every output
    starts a structure at once: "call ", JSON of the schema, ";" follow, then free text again. The
    first structure is at most 23 bytes, so max_tokens 30 always completes it."""
    (at,) = tokenizer.encode("@")
    city = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tag = {"structures": [{"begin": "@call ", "schema": city, "end": ";"}], "triggers": ["@"]}
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=1,
        n=3,
        max_tokens=30,
        logit_bias={str(at): 100},
        extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}},
    )
    for choice in answer.choices:
        text = choice.message.content or ""
        assert text.startswith("@call "), text
        calls = re.findall(r"@call (.*?);", text)
        assert calls, text
        for call in calls:
            jsonschema.validate(json.loads(call), city)
        assert text.count("@") - len(calls) <= 1  # only the last one may be cut by max_tokens


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"structured_outputs": {"regex": "[a-z+("}}, "structured_outputs.regex", "unclosed character class"),
        ({"guided_regex": "(?=a)b"}, "guided_regex", "look-around"),
        (
            {"structured_outputs": {"grammar": "start: missing_rule\n"}},
            "structured_outputs.grammar",
            "missing_rule",
        ),
        ({"grammar": 'root ::= <[42]> "x"'}, "grammar", "token references"),
        (
            {"structured_outputs": {"structural_tag": {"structures": [], "triggers": ["@"]}}},
            "structured_outputs.structural_tag",
            "structures",
        ),
        (
            {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}},
            "structured_outputs.json",
            "schema",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "response_format",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_cannot_compile_is_a_400_naming_the_field(client, extra, param, words, stream):
    with pytest.raises(openai.BadRequestError) as info:
        result = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4, stream=stream, extra_body=extra
        )
        if stream:
            list(result)
    assert info.value.status_code == 400 and info.value.param == param
    assert words in str(info.value.body)


def test_the_worker_still_serves_after_refused_grammars(client):
    assert chat_texts(client, {"guided_choice": ["ok"]}, stream=False, n=2) == ["ok", "ok"]
