# ruff: noqa: RUF001 (DeepSeek's markers have full-width bars and U+2581)
"""Every family's tool-call and reasoning parser: what it reads, at any split, and malformed text."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from worker.formats.base import CallPiece, ContentPiece
from worker.formats.registry import REASONING_PARSERS, TOOL_PARSERS, reasoning_stage, tool_call_stream


def run_tools(parser_name: str, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    parser = tool_call_stream(parser_name)
    pieces = []
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in itertools.pairwise(bounds):
        pieces += parser.push(text[a:b])
    pieces += parser.finish()
    content = "".join(p.text for p in pieces if isinstance(p, ContentPiece))
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if isinstance(p, CallPiece):
            entry = calls.setdefault(p.tool_index, ["", ""])
            entry[0] += p.name
            entry[1] += p.arguments
    return content, [(name, json.loads(args)) for name, args in calls.values()]


def every_split(parser_name: str, text: str, seed: int = 0) -> tuple[str, list[tuple[str, dict]]]:
    """The result of parsing ``text`` whole; asserts that 40 random splits give the same."""
    whole = run_tools(parser_name, text, [])
    rng = random.Random(seed)
    for _ in range(40):
        cuts = rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))
        assert run_tools(parser_name, text, cuts) == whole
    assert run_tools(parser_name, text, list(range(1, len(text)))) == whole  # one character at a time
    return whole


WEATHER = ("get_weather", {"city": "Paris", "days": 2})
CALLS = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    ),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    ("llama3_json", '<|python_tag|>get_weather.call(city="Paris", days=2)'),  # a built-in tool
    ("pythonic", '[get_weather(city="Paris", days=2)]'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "days": 2}'),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    ),
    (
        "deepseek_v31",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ),
    (
        "openai",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "days": 2}<|call|>',
    ),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'),
    (
        "glm45",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    ),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'),
    ("gemma4", '<|tool_call>call:get_weather{"city": "Paris", "days": 2}<tool_call|>'),  # forced: JSON values
    (
        "nemotron_json",
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]</TOOLCALL>',
    ),
    ("lfm2", '<|tool_call_start|>[get_weather(city="Paris", days=2)]<|tool_call_end|>'),
]


@pytest.mark.parametrize(("parser", "text"), CALLS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CALLS)])
def test_each_format_gives_the_call_at_any_split(parser: str, text: str) -> None:
    assert every_split(parser, text) == ("", [WEATHER])


@pytest.mark.parametrize(("parser", "text"), CALLS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CALLS)])
def test_content_before_a_call_stays_content(parser: str, text: str) -> None:
    if parser in ("pythonic", "llama3_json"):
        return  # these formats are a call only when the answer starts with it
    assert every_split(parser, "Let me check. " + text) == ("Let me check. ", [WEATHER])


def test_mistral_calls_before_one_cut_short_stay_calls() -> None:
    """max_tokens can end a v11+ answer inside its last call: the complete calls are calls, the rest text."""
    cut = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{"y": 2}[TOOL_CALLS]a[ARGS]{"x": '
    assert every_split("mistral", cut) == ('[TOOL_CALLS]a[ARGS]{"x": ', [("a", {"x": 1}), ("b", {"y": 2})])


def test_several_calls_in_one_section() -> None:
    two = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'
    assert every_split("mistral", two) == ("", [("a", {"x": 1}), ("b", {})])
    assert every_split("pythonic", "[a(x=[1, 2], y=None, z=true), b()]") == (
        "",
        [("a", {"x": [1, 2], "y": None, "z": True}), ("b", {})],
    )
    assert every_split(
        "llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b"}'
    ) == (
        "",
        [("a", {"x": 1}), ("b", {})],
    )
    assert every_split("granite", '<|tool_call|>[{"name": "a", "arguments": {}}, {"name": "b"}]') == (
        "",
        [("a", {}), ("b", {})],
    )


MALFORMED = [
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[os.system('x') + 1]"),
    ("pythonic", "[f(x=__import__('os'))]"),
    ("pythonic", "[f(1)"),
    ("llama3_json", "<|python_tag|>import math\nprint(math.pi)"),
    ("llama3_json", '<|python_tag|>os.system.call(x="y")'),
    ("llama3_json", '<|python_tag|>{"name": "a"} trailing'),
    ("mistral", "[TOOL_CALLS]not json"),
    ("mistral", "[TOOL_CALLS]name[ARGS]{unclosed"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>garbage<｜tool▁calls▁end｜>"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{bad"),
    ("openai", "<|channel|>commentary to=functions.f<|message|>[1]<|call|>"),
    ("phi4_mini_json", "functools[{]"),
    ("granite", '<|tool_call|>[{"arguments": {}}]'),
    ("glm45", "<tool_call>two\nlines<arg_key>k</arg_key></tool_call>"),
    ("qwen3_coder", "<tool_call><function=f>junk</function></tool_call>"),
    ("qwen3_coder", "<tool_call><function=f>"),
    ("gemma4", '<|tool_call>call:f{city:<|"|>Paris}<tool_call|>'),
    ("gemma4", "<|tool_call>call:f{a:1,}<tool_call|>"),
    ("gemma4", "<|tool_call>f{a:1}<tool_call|>"),
    ("gemma4", "<|tool_call>call:f[1]<tool_call|>"),
    ("nemotron_json", "<TOOLCALL>[{]</TOOLCALL>"),
    ("lfm2", "<|tool_call_start|>[os.system('x') + 1]<|tool_call_end|>"),
]


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_calls_come_back_as_content(parser: str, text: str) -> None:
    content, calls = every_split(parser, text)
    assert calls == []
    assert content.strip() == text.strip()


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_plain_text_is_content(parser: str) -> None:
    text = "The weather in Paris is mild: 20 °C, [sunny] and {calm}."
    assert every_split(parser, text) == (text, [])


def run_reasoning(name: str, text: str, cuts: list[int], starts: bool = False) -> list[tuple[str, str]]:
    stage = reasoning_stage(name, starts)
    pieces: list[tuple[str, str]] = []
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in itertools.pairwise(bounds):
        pieces += stage.push(text[a:b])
    pieces += stage.finish()
    merged: list[tuple[str, str]] = []
    for kind, piece in pieces:
        if merged and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + piece)
        elif piece:
            merged.append((kind, piece))
    return merged


REASONING = [
    ("qwen3", "<think>\nhmm\n</think>\n\nHello!", False),
    ("deepseek_r1", "hmm\n</think>\n\nHello!", True),
    ("glm45", "<think>hmm</think>Hello!", False),
    ("mistral", "[THINK]hmm[/THINK]Hello!", False),
    ("granite", "<think>hmm</think><response>Hello!</response>", False),
    ("gemma4", "<|channel>thought\nhmm<channel|>Hello!", False),
    (
        "openai_gptoss",
        "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
        False,
    ),
]


def test_every_declared_format_has_cases_here() -> None:
    """A new format file (worker/formats/) needs its calls, malformed text and thinking tested here."""
    assert {p for p, _ in CALLS} == set(TOOL_PARSERS)
    # Hermes's malformed blocks are tested in test_output_parsers.py.
    assert {p for p, _ in MALFORMED} | {"hermes"} == set(TOOL_PARSERS)
    assert {name for name, _, _ in REASONING} == set(REASONING_PARSERS)


@pytest.mark.parametrize(("name", "text", "starts"), REASONING)
def test_reasoning_formats_at_any_split(name: str, text: str, starts: bool) -> None:
    whole = run_reasoning(name, text, [], starts)
    assert [(k, t.strip()) for k, t in whole] == [("reasoning", "hmm"), ("content", "Hello!")]
    rng = random.Random(1)
    for _ in range(40):
        cuts = rng.sample(range(1, len(text)), rng.randint(1, 8))
        assert run_reasoning(name, text, cuts, starts) == whole


def test_harmony_call_passes_through_the_channel_stage() -> None:
    text = (
        "<|channel|>analysis<|message|>need weather<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}'
    )
    pieces = run_reasoning("openai_gptoss", text, [])
    assert pieces[0] == ("reasoning", "need weather")
    assert pieces[1][0] == "content"
    assert run_tools("openai", pieces[1][1], []) == ("", [WEATHER])


def test_harmony_recipient_in_the_role_header() -> None:
    text = (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris", "days": 2}<|call|>'
    )
    pieces = run_reasoning("openai_gptoss", text, [])
    assert run_tools("openai", pieces[0][1], []) == ("", [WEATHER])


def test_text_that_is_not_harmony_is_content() -> None:
    assert run_reasoning("openai_gptoss", "Just text.", [3]) == [("content", "Just text.")]


def test_gemma4_notation_nested_values_and_parallel_calls() -> None:
    """Gemma 4's own notation (as its chat template writes arguments): bare keys, ``<|"|>`` strings
    holding what JSON would escape, nested objects and lists, literals; two calls back to back."""
    q = '<|"|>'
    text = (
        f'<|tool_call>call:search{{query:{q}a "b", c{q},filters:{{tags:[{q}x{q},{q}y{q}],exact:true}},'
        f"limit:3,cursor:null,ratio:-0.5}}<tool_call|><|tool_call>call:ping{{}}<tool_call|>"
    )
    assert every_split("gemma4", text) == (
        "",
        [
            (
                "search",
                {
                    "query": 'a "b", c',
                    "filters": {"tags": ["x", "y"], "exact": True},
                    "limit": 3,
                    "cursor": None,
                    "ratio": -0.5,
                },
            ),
            ("ping", {}),
        ],
    )
