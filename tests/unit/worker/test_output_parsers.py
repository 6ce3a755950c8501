"""Tool-call, reasoning and output parsers: the same result however the text is split."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from transformers import AutoTokenizer

from worker.formats.base import CallPiece, ContentPiece
from worker.formats.hermes import ToolCallParser
from worker.formats.think import ReasoningParser
from worker.output.choice_output import ChoiceOutput
from worker.output.detokenizer import IncrementalDetokenizer
from worker.types import ContentDelta, OutputOptions, ReasoningDelta, ToolCallDelta

TOOL_TEXTS = [
    'Let me check.<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Zürich 🌧", "n": [1, {"x": "}"}]}}\n</tool_call>',
    '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}'
    "</tool_call>",
    '{"name": "lookup", "arguments": {"q": "caf\\u00e9 \\"quoted\\" <tool_call> \\\\"}}',
    '{"name": "x", "parameters": {"k": true}}\n{"name": "y"}',
    "No tools here, just text with a < sign, {braces} and <tool_ without a call.",
    '<tool_call>{"foo": 1}</tool_call> after',
    '{"name": "s", "arguments": "{\\"a\\": 2}"}',
    '<tool_call>{"name": "cut", "arguments": {"a": "unfinished',
]
REASONING_TEXTS = [
    "  <think>\nLet me think: 2+2 = 4. </th not yet</think>\n\nThe answer is 4.",
    "Plain answer <think> not a block </think>",
    "<think>only thinking, never closed",
    "<thi",
]


def random_splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 16))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def run_tools(pieces: list[str]) -> tuple[str, list[tuple[str, str, int]]]:
    ids = itertools.count()
    parser = ToolCallParser(id_factory=lambda: f"call_{next(ids)}")
    out = [piece for text in pieces for piece in parser.push(text)] + parser.finish()
    content = "".join(p.text for p in out if isinstance(p, ContentPiece))
    calls: dict[int, list] = {}
    for p in out:
        if isinstance(p, CallPiece):
            call = calls.setdefault(p.tool_index, ["", "", 0])
            if p.name:
                call[0], call[2] = p.name, call[2] + 1
            call[1] += p.arguments
    return content, [tuple(c) for c in calls.values()]


def run_reasoning(pieces: list[str], starts_thinking: bool = False) -> tuple[str, str]:
    parser = ReasoningParser(starts_thinking)
    out = [piece for text in pieces for piece in parser.push(text)] + parser.finish()
    return "".join(t for k, t in out if k == "reasoning"), "".join(t for k, t in out if k == "content")


@pytest.mark.parametrize("text", TOOL_TEXTS)
def test_tool_calls_do_not_depend_on_splitting(text):
    whole = run_tools([text])
    rng = random.Random(text)
    for _ in range(150):
        assert run_tools(random_splits(text, rng)) == whole


def test_tool_call_results():
    content, calls = run_tools([TOOL_TEXTS[0]])
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Zürich 🌧", "n": [1, {"x": "}"}]}', 1)]
    assert [(n, json.loads(a)) for n, a, _ in run_tools([TOOL_TEXTS[1]])[1]] == [("f", {"a": 1}), ("g", {})]
    assert json.loads(run_tools([TOOL_TEXTS[2]])[1][0][1]) == {"q": 'café "quoted" <tool_call> \\'}
    assert [(n, a) for n, a, _ in run_tools([TOOL_TEXTS[3]])[1]] == [("x", '{"k": true}'), ("y", "{}")]
    assert run_tools([TOOL_TEXTS[4]]) == (TOOL_TEXTS[4], [])
    assert run_tools([TOOL_TEXTS[5]]) == (TOOL_TEXTS[5], [])  # no name: it was content
    assert run_tools([TOOL_TEXTS[6]])[1] == [("s", '{"a": 2}', 1)]  # arguments given as a JSON string


def test_the_name_comes_before_any_argument_fragment():
    parser = ToolCallParser()
    pieces = [p for ch in TOOL_TEXTS[1] for p in parser.push(ch)] + parser.finish()
    first_call = [p for p in pieces if isinstance(p, CallPiece) and p.tool_index == 0]
    assert first_call[0].name == "f" and first_call[0].call_id and first_call[0].arguments == ""
    assert all(not p.name and not p.call_id for p in first_call[1:])


@pytest.mark.parametrize("text", REASONING_TEXTS)
def test_reasoning_does_not_depend_on_splitting(text):
    whole = run_reasoning([text])
    rng = random.Random(text)
    for _ in range(150):
        assert run_reasoning(random_splits(text, rng)) == whole
    assert "<think>" not in whole[1].replace("<think> not a block", "")


def test_reasoning_results():
    assert run_reasoning([REASONING_TEXTS[0]]) == (
        "\nLet me think: 2+2 = 4. </th not yet",
        "The answer is 4.",
    )
    assert run_reasoning([REASONING_TEXTS[1]]) == ("", REASONING_TEXTS[1])
    assert run_reasoning([REASONING_TEXTS[2]]) == ("only thinking, never closed", "")
    assert run_reasoning(["already thinking</think>answer"], starts_thinking=True) == (
        "already thinking",
        "answer",
    )


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def run_output(tokenizer, text: str, options: OutputOptions) -> list:
    """Token by token through the real detokenizer (so splits fall inside multi-byte characters) into a
    ChoiceOutput; returns the events."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok, output, events = IncrementalDetokenizer(tokenizer, []), ChoiceOutput(0, options), []
    for token in ids:
        output.add_token(token, None)
        events += output.push(detok.push(token))
    return events + output.finish(detok.flush())


def summarize(events: list) -> tuple[str, str, list[tuple[str, str]], int]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            call = calls.setdefault(e.tool_index, ["", ""])
            call[0] = call[0] or e.name
            call[1] += e.arguments
    ids = sum(len(e.token_ids) for e in events if isinstance(e, ContentDelta | ReasoningDelta))
    return content, reasoning, [tuple(c) for c in calls.values()], ids


def test_token_by_token_output_equals_the_whole_parse(tokenizer):
    text = (
        '<think>Weather? Use the tool 🌦.</think>\nSure — checking.<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "São Paulo"}}\n</tool_call>'
    )
    options = OutputOptions(tool_calls=True, reasoning=True)
    content, reasoning, calls, _ = summarize(run_output(tokenizer, text, options))
    assert reasoning == "Weather? Use the tool 🌦."
    assert content == "Sure — checking."
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "São Paulo"})]


def test_turned_off_reasoning_is_dropped_and_markers_never_reach_content(tokenizer):
    options = OutputOptions(reasoning=True, keep_reasoning=False)
    content, reasoning, calls, _ = summarize(run_output(tokenizer, "<think>secret</think>Answer.", options))
    assert (content, reasoning, calls) == ("Answer.", "", [])


def test_token_ids_are_reported_once_for_content_and_reasoning(tokenizer):
    text = "<think>a b c</think>d e f"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    *_, reported = summarize(run_output(tokenizer, text, OutputOptions(reasoning=True)))
    assert reported == len(ids)


# What real tool-calling models emit: code and paths in arguments, raw control characters, cut output.
MALFORMED_TOOL_TEXTS = [
    '<tool_call>{"name": "run", "arguments": {"path": "C:\\Users\\qa\\new"}}</tool_call>',
    '<tool_call>{"name": "r\\q", "arguments": {"code": "line1\nline2\t\x01"}}</tool_call>',
    '{"name": "x\ny", "arguments": {"a": "\\u12"}}',
    '{"name": "s", "arguments": "{\\"a\\": \\q}"}',
    '<tool_call>{"na\\me": "f", "arguments": {"unterminated": "abc',
    '<tool_call>{"name": "f", "arguments": {"a": [1, 2',
    '<tool_call>{"name": "\\ud83d", "arguments": {}}</tool_call>',
    '{"name": "cut\\',
    '<tool_call>{"name": "f", "arguments": {"a": 1}}}}]]</tool_call> tail "\\x" {',
]


@pytest.mark.parametrize("text", MALFORMED_TOOL_TEXTS)
def test_malformed_tool_call_text_never_raises_whatever_the_split(text):
    whole = run_tools([text])
    for cut in range(1, len(text)):  # every two-piece split
        assert run_tools([text[:cut], text[cut:]]) == whole
    for end in range(len(text) + 1):  # truncated at every point, as a max_tokens cut would
        content, calls = run_tools([text[:end]])
        for name, arguments, _ in calls:
            name.encode("utf-8")  # valid on any UTF-8 wire
            arguments.encode("utf-8")
        assert isinstance(content, str)
    assert run_tools(list(text)) == whole  # character by character
