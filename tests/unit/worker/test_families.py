# ruff: noqa: RUF001 (DeepSeek's markers have full-width bars and U+2581)
"""Real tokenizers and chat templates (tools/fixtures.py, tests/fixtures/templates): each family's
profile, its template rendered through the worker's prompt code, round trips of the template's own
tool calls through the detokenizer and parsers, and forced calls in the family's own format."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tools.fixtures import DEFAULT_DIR, fetch_all
from worker.output.choice_output import ChoiceOutput
from worker.output.detokenizer import IncrementalDetokenizer
from worker.prompts.family import FamilyProfile, choose_profile
from worker.prompts.prompt import ChatMessage, ChatPrompt, PromptRenderer
from worker.sampling.grammar import GrammarCompiler, GrammarSpec
from worker.types import ContentDelta, OutputOptions, ReasoningDelta, ToolCallDelta

pytestmark = pytest.mark.slow  # left out of make test-fast

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "templates"
# (case, model_type, tokenizer fixture, vendored template or None for the tokenizer's own,
#  expected tool parser, expected reasoning parser)
CASES = [
    ("qwen3", "qwen3", "qwen3", None, "hermes", "qwen3"),
    ("qwen2.5", "qwen2", "qwen3", "Qwen-Qwen2.5-7B-Instruct", "hermes", "qwen3"),
    ("qwen3-coder", "qwen3_moe", "qwen3", "Qwen3-Coder", "qwen3_coder", "qwen3"),
    ("llama3.1", "llama", "llama3_1", "meta-llama-Llama-3.1-8B-Instruct", "llama3_json", None),
    ("llama3.2", "llama", "llama3_1", "meta-llama-Llama-3.2-3B-Instruct", "llama3_json", None),
    ("gemma3", "gemma3_text", "gemma3", None, "hermes", None),
    ("deepseek-v3", "deepseek_v3", "deepseek_v3", None, "deepseek_v3", None),  # the tokenizer's own
    ("gpt-oss", "gpt_oss", "gptoss", "openai-gpt-oss-120b", "openai", "openai_gptoss"),
    (
        "deepseek-v3.1",
        "deepseek_v3",
        "deepseek_v3",
        "deepseek-ai-DeepSeek-V3.1",
        "deepseek_v31",
        "deepseek_r1",
    ),
    (
        "deepseek-r1",
        "qwen2",
        "deepseek_v3",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        "deepseek_v3",
        "deepseek_r1",
    ),
    ("mistral-nemo", "mistral", "llama3_1", "mistralai-Mistral-Nemo-Instruct-2407", "mistral", None),
    ("mistral-small-3.2", "mistral", "llama3_1", "Mistral-Small-3.2-24B-Instruct-2506", "mistral", None),
    (
        "ministral-3-reasoning",
        "mistral3",
        "llama3_1",
        "mistralai-Ministral-3-14B-Reasoning-2512",
        "mistral",
        "mistral",
    ),
    ("glm-4.6", "glm4_moe", "qwen3", "GLM-4.6", "glm45", "glm45"),
    ("granite-3.3", "granite", "qwen3", "ibm-granite-granite-3.3-2B-Instruct", "granite", "granite"),
    # The models of 2026, with the closest tokenizer the registries offer and their own templates.
    ("qwen3.5", "qwen3_5", "qwen3", "Qwen3.5-4B", "qwen3_coder", "qwen3"),
    ("gemma4", "gemma4_text", "gemma3", "google-gemma-4-31B-it", "gemma4", "gemma4"),
    ("granite-4.0", "granitemoehybrid", "llama3_1", "ibm-granite-granite-4.0", "hermes", None),
    ("nemotron-nano-2", "nemotron_h", "qwen3", "NVIDIA-Nemotron-Nano-v2", "nemotron_json", "qwen3"),
    ("lfm2", "lfm2", "llama3_1", "LFM2-8B-A1B", "lfm2", None),
]
IDS = [case[0] for case in CASES]
BY_NAME = {case[0]: case for case in CASES}
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    """The fetched tokenizers: fetched here when missing (a failed fetch fails, never skips)."""
    fetch_all(DEFAULT_DIR)
    return DEFAULT_DIR


_TOKENIZERS: dict[str, Any] = {}


def tokenizer(fixture_dir: Path, name: str) -> Any:
    from transformers import AutoTokenizer

    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = AutoTokenizer.from_pretrained(fixture_dir / name)
    return _TOKENIZERS[name]


_PROFILES: dict[str, FamilyProfile] = {}
_COMPILERS: dict[str, GrammarCompiler] = {}


def setup(fixture_dir: Path, case: tuple) -> tuple[Any, FamilyProfile]:
    """The case's tokenizer and profile, each built once per module (choosing a profile renders the
    template many times)."""
    name, model_type, tok_name, template, *_ = case
    tok = tokenizer(fixture_dir, tok_name)
    if name not in _PROFILES:
        text = (TEMPLATES / f"{template}.jinja").read_text() if template else None
        _PROFILES[name] = choose_profile(model_type, tok, template=text)
    return tok, _PROFILES[name]


def compiler_for(fixture_dir: Path, tok_name: str) -> GrammarCompiler:
    """One grammar compiler per tokenizer (its table takes seconds to build for 150k+ tokens)."""
    if tok_name not in _COMPILERS:
        tok = tokenizer(fixture_dir, tok_name)
        _COMPILERS[tok_name] = GrammarCompiler(tok, {tok.eos_token_id})
    return _COMPILERS[tok_name]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_profile_names_the_family_formats(fixture_dir: Path, case: tuple) -> None:
    _, profile = setup(fixture_dir, case)
    assert (profile.tool_parser, profile.reasoning_parser) == (case[4], case[5])


def call_turn(call_id: str = "call_0123456789abcdef01234567") -> list[ChatMessage]:
    call = {"id": call_id, "name": "get_weather", "arguments": '{"city": "Paris"}'}
    return [
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", None, tool_calls=(call,), reasoning_content="I should look it up."),
        ChatMessage("tool", "20 C and sunny", tool_call_id=call_id, name="get_weather"),
    ]


SCENARIOS = {
    "plain": lambda: ChatPrompt((ChatMessage("system", "Be brief."), ChatMessage("user", "Hello"))),
    "tools": lambda: ChatPrompt((ChatMessage("user", "Weather in Paris?"),), tools=(WEATHER,)),
    "call-and-result": lambda: ChatPrompt(tuple(call_turn()), tools=(WEATHER,)),
    "thinking-on": lambda: ChatPrompt(
        (ChatMessage("user", "Hi"),), template_kwargs={"enable_thinking": True}
    ),
    "thinking-off": lambda: ChatPrompt(
        (ChatMessage("user", "Hi"),), template_kwargs={"enable_thinking": False}
    ),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_template_matrix_renders(fixture_dir: Path, case: tuple, scenario: str) -> None:
    tok, profile = setup(fixture_dir, case)
    ids, text = PromptRenderer(tok, profile).render(SCENARIOS[scenario]())
    assert ids and text
    if scenario in ("tools", "call-and-result"):
        assert "get_weather" in text
    if scenario == "call-and-result":
        assert "Paris" in text and "20 C and sunny" in text
        if profile.nine_char_ids:
            assert "call_0123456789abcdef01234567" not in text


def test_thinking_switch_changes_the_prompt_where_the_template_has_one(fixture_dir: Path) -> None:
    for case in CASES:
        tok, profile = setup(fixture_dir, case)
        renderer = PromptRenderer(tok, profile)
        on = renderer.render(SCENARIOS["thinking-on"]())[1]
        off = renderer.render(SCENARIOS["thinking-off"]())[1]
        if case[0] in ("qwen3", "deepseek-v3.1", "gpt-oss", "granite-3.3"):
            assert on != off, case[0]


def parse_generated(
    tok: Any, profile: FamilyProfile, completion: str | list[int], prompt_ids: list[int], seed: int
) -> tuple:
    """``completion`` (text, tokenized here, or token ids) detokenized and parsed in random groups of
    tokens: (calls, reasoning, content)."""
    ids = completion
    if isinstance(completion, str):
        ids = tok(completion, add_special_tokens=False)["input_ids"]
    options = OutputOptions(
        tool_calls=True,
        reasoning=profile.reasoning_parser is not None,
        tool_parser=profile.tool_parser,
        reasoning_parser=profile.reasoning_parser or "qwen3",
        keep_special_tokens=profile.keep_special_tokens,
    )
    detok = IncrementalDetokenizer(tok, prompt_ids, not profile.keep_special_tokens)
    out = ChoiceOutput(0, options)
    events: list = []
    rng = random.Random(seed)
    pending = ""
    for token in ids:
        pending += detok.push(token)
        if rng.random() < 0.5:
            events += out.push(pending)
            pending = ""
    events += out.push(pending) + out.finish(detok.flush())
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            entry = calls.setdefault(e.tool_index, ["", ""])
            entry[0] += e.name
            entry[1] += e.arguments
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return [(n, json.loads(a)) for n, a in calls.values()], reasoning.strip(), content.strip()


# Gemma 3 has no tool format; Granite 3.3's and LFM2's templates do not render earlier calls.
FORCED = ["qwen3", "gpt-oss", "llama3.1", "deepseek-v3.1"]
ROUND_TRIPS = [c for c in CASES if c[0] not in ("gemma3", "granite-3.3", "lfm2")]


@pytest.mark.parametrize("case", ROUND_TRIPS, ids=[c[0] for c in ROUND_TRIPS])
def test_the_templates_own_tool_call_parses_back(fixture_dir: Path, case: tuple) -> None:
    tok, profile = setup(fixture_dir, case)
    renderer = PromptRenderer(tok, profile)
    # A template that lists no tools (DeepSeek V3's) gets them in the system message: left out here,
    # so the prompt is a prefix of the template's own rendering of the call.
    tools = (WEATHER,) if profile.template_tools else ()
    user = ChatPrompt((ChatMessage("user", "Weather in Paris?"),), tools=tools)
    prompt_ids, prompt = renderer.render(user)
    with_call = ChatPrompt(tuple(call_turn()[:2]), tools=(WEATHER,))
    kwargs: dict[str, Any] = {"tools": [{"type": "function", "function": WEATHER}]}
    if profile.template:
        kwargs["chat_template"] = profile.template
    messages = [renderer._message_dict(m) for m in with_call.messages]
    full = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    common = len(_common_prefix(prompt, full))
    if common < len(prompt):  # the prompt opened more (R1's "<think>"): the call starts after a marker
        common = full.rindex(">", 0, common) + 1
    completion = full[common:]
    for seed in range(8):
        calls, _, _ = parse_generated(tok, profile, completion, list(prompt_ids), seed)
        assert calls == [("get_weather", {"city": "Paris"})], completion


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


@pytest.mark.parametrize(
    ("case", "completion"),
    [
        (BY_NAME["qwen3"], "<think>\nNeed the weather.\n</think>\n\nIt is sunny."),
        (
            BY_NAME["gpt-oss"],
            "<|channel|>analysis<|message|>Need the weather.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>It is sunny.",
        ),
    ],
    ids=["qwen3", "gpt-oss"],
)
def test_reasoning_round_trips_through_the_real_tokenizer(
    fixture_dir: Path, case: tuple, completion: str
) -> None:
    tok, profile = setup(fixture_dir, case)
    for seed in range(8):
        _, reasoning, content = parse_generated(tok, profile, completion, [], seed)
        assert (reasoning, content) == ("Need the weather.", "It is sunny.")


@pytest.mark.parametrize(
    "case",
    [BY_NAME[n] for n in ("qwen3", "gpt-oss", "llama3.1", "deepseek-v3.1")],
    ids=["qwen3", "gpt-oss", "llama3.1", "deepseek-v3.1"],
)
def test_a_forced_call_takes_the_familys_own_markers(fixture_dir: Path, case: tuple) -> None:
    """The grammar admits the family's call tokenized as the model would write it, and with Qwen3's
    one-token ``<tool_call>`` the first token it allows is that token (the old bug: spelled out)."""
    tok, profile = setup(fixture_dir, case)
    compiler = compiler_for(fixture_dir, case[2])
    spec = GrammarSpec(
        "tool_call", functions=(("get_weather", WEATHER["parameters"]),), call_format=profile.call_grammar
    )
    constraint = compiler.constraint(compiler.validate(spec))
    import torch

    row = torch.zeros(constraint.mask_words, dtype=torch.int32)
    constraint.fill_mask(row)
    allowed = [t for t in range(len(tok)) if (int(row[t // 32]) >> (t % 32)) & 1]
    texts = {
        "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>',
        "openai": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Paris"}<|call|>',
        "llama3_json": '{"name":"get_weather","parameters":{"city":"Paris"}}',
        "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city":"Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    }
    ids = tok(texts[profile.call_grammar], add_special_tokens=False)["input_ids"]
    assert ids[0] in allowed
    if case[0] == "qwen3":
        assert allowed == [tok.convert_tokens_to_ids("<tool_call>")]
    for token in ids:
        constraint.fill_mask(row)
        assert (int(row[token // 32]) >> (token % 32)) & 1, tok.decode([token])
        constraint.advance(token)
    assert constraint.error is None


def allowed_tokens(constraint: Any) -> list[int]:
    import torch

    row = torch.zeros(constraint.mask_words, dtype=torch.int32)
    constraint.fill_mask(row)
    bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return [int(t) for t in bits.flatten().nonzero()[:, 0]]


CHOICE = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city"],
}


@pytest.mark.parametrize(
    ("name", "parser"),
    [
        ("qwen3-coder", "auto"),
        ("glm-4.6", "auto"),
        ("llama3.2", "pythonic"),
        ("gemma4", "auto"),
        ("lfm2", "auto"),
    ],
    ids=["qwen3_coder", "glm45", "pythonic", "gemma4", "lfm2"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_tagged_forced_call_is_the_familys_format_and_parses(
    fixture_dir: Path, name: str, parser: str, seed: int
) -> None:
    """Any token path the grammar allows (random among the allowed tokens) is a call in the
    family's own format that its parser reads back; single-token markers are forced as that token."""
    case = BY_NAME[name]
    tok = tokenizer(fixture_dir, case[2])
    template = (TEMPLATES / f"{case[3]}.jinja").read_text()
    profile = choose_profile(case[1], tok, template=template, tool_call_parser=parser)
    assert profile.call_grammar == (parser if parser != "auto" else case[4])
    compiler = compiler_for(fixture_dir, case[2])
    spec = GrammarSpec("tool_call", functions=(("get_weather", CHOICE),), call_format=profile.call_grammar)
    constraint = compiler.constraint(compiler.validate(spec))
    rng = random.Random(seed)
    ids: list[int] = []
    while not constraint.finished and len(ids) < 100:
        allowed = allowed_tokens(constraint)
        if not ids and "<tool_call>" in tok.get_added_vocab():
            assert allowed == [tok.convert_tokens_to_ids("<tool_call>")]
        ids.append(rng.choice(allowed))
        constraint.advance(ids[-1])
    assert constraint.finished and constraint.error is None
    calls, _, content = parse_generated(tok, profile, tok.decode(ids), [], seed)
    assert content == "" and len(calls) == 1
    call_name, arguments = calls[0]
    assert call_name == "get_weather" and arguments["city"] in ("Paris", "Oslo")
    assert set(arguments) <= {"city", "days"} and arguments.get("days", 1) in (1, 2, 3)


@pytest.mark.parametrize("special", [False, True], ids=["text-markers", "special-markers"])
def test_llamas_builtin_tool_call_parses_back(fixture_dir: Path, special: bool) -> None:
    """A built-in tool's call as the template renders it (``<|python_tag|>brave_search.call(...)``,
    ended by ``<|eom_id|>``, one of the profile's stop tokens) parses back at random splits. The
    fixture tokenizer (npm's ``llama3_1``) is Llama 3.0's, whose ids 128008/128010 are still reserved:
    the markers are text there; with them added as special tokens the profile keeps special tokens."""
    import copy

    name = "llama3.1"  # 3.2's template renders no built-in tools
    tok = tokenizer(fixture_dir, BY_NAME[name][2])
    if special:
        tok = copy.deepcopy(tok)
        tok.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "<|eom_id|>"]})
    template = (TEMPLATES / f"{BY_NAME[name][3]}.jinja").read_text()
    profile = choose_profile("llama", tok, template=template)
    assert "<|eom_id|>" in profile.stop_tokens and profile.keep_special_tokens == special
    call = {"name": "brave_search", "arguments": {"query": "Paris weather"}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": call}]},
    ]
    kwargs: dict[str, Any] = {"builtin_tools": ["brave_search"], "chat_template": template}
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True, **kwargs)
    full = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    completion = full[len(prompt) :].removesuffix("<|eom_id|>")
    assert completion.startswith("<|python_tag|>") and full.endswith("<|eom_id|>"), full
    for seed in range(8):
        assert parse_generated(tok, profile, completion, [], seed) == (
            [("brave_search", {"query": "Paris weather"})],
            "",
            "",
        )
