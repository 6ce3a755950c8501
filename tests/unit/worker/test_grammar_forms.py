"""The caller-written constraint forms (choice, regex, Lark, GBNF, structural tag) with the default
model's tokenizer: random walks of each compiled grammar match the constraint; bad text is refused
naming the field; the wire fields reach the right grammar kind."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from sluice.v1 import worker_pb2 as pb
from worker.errors import InvalidRequest
from worker.sampling.grammar import GrammarCompiler, GrammarSpec, TokenConstraint
from worker.service.convert import parse_request

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, {tokenizer.eos_token_id})


def walk(
    constraint: TokenConstraint, eos: int, rng: random.Random, steps: int = 60
) -> tuple[list[int], bool]:
    """A random path through the grammar: each step draws one allowed token (EOS, when allowed, with
    probability 1/4); returns the tokens and whether the grammar ended (EOS drawn, or stopped)."""
    row = torch.zeros(constraint.mask_words, dtype=torch.int32)
    tokens: list[int] = []
    for _ in range(steps):
        if constraint.finished:
            return tokens, True
        constraint.fill_mask(row)
        allowed = np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")).tolist()
        assert allowed, "the grammar allows no token"
        if eos in allowed and rng.random() < 0.25:
            return tokens, True
        token = rng.choice([t for t in allowed if t != eos] or allowed)
        if token == eos:
            return tokens, True
        constraint.advance(token)
        assert constraint.error is None
        tokens.append(token)
    return tokens, constraint.finished


def walks(
    compiler: GrammarCompiler, tokenizer, spec: GrammarSpec, count: int = 20, steps: int = 60
) -> list[str]:
    """The texts of ``count`` random walks that ended within ``steps`` tokens (at least one must)."""
    source = compiler.validate(spec)
    rng = random.Random(7)
    texts = []
    for _ in range(count):
        tokens, ended = walk(compiler.constraint(source), tokenizer.eos_token_id, rng, steps)
        if ended:
            texts.append(tokenizer.decode(tokens))
    assert texts
    return texts


def accepts(compiler: GrammarCompiler, tokenizer, spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar takes ``text`` (tokenized as the model would write it) whole."""
    constraint = compiler.constraint(compiler.validate(spec))
    matcher = constraint._matcher
    for token in tokenizer.encode(text):
        if not matcher.consume_token(token):
            return False
    return bool(matcher.is_accepting())


def test_choice_walks_are_one_of_the_choices(compiler, tokenizer):
    choices = ("yes", "no", "maybe so", "Été")
    spec = GrammarSpec("choice", choices=choices)
    assert set(walks(compiler, tokenizer, spec)) <= set(choices)
    assert accepts(compiler, tokenizer, spec, "maybe so")
    assert not accepts(compiler, tokenizer, spec, "maybe")
    assert not accepts(compiler, tokenizer, spec, "yes no")


def test_regex_walks_fullmatch(compiler, tokenizer):
    pattern = r"(ab|cd)[0-9]{2,4}-[A-Z]+"
    for text in walks(compiler, tokenizer, GrammarSpec("regex", text=pattern), steps=40):
        assert re.fullmatch(pattern, text), text
    assert accepts(compiler, tokenizer, GrammarSpec("regex", text=r"a/b\d"), "a/b7")  # a slash is plain text


def test_lark_walks_parse(compiler, tokenizer):
    lark = 'start: "sum(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/\n'
    for text in walks(compiler, tokenizer, GrammarSpec("lark", text=lark)):
        assert re.fullmatch(r"sum\([0-9]{1,3}(,[0-9]{1,3})*\)", text), text


def test_lark_embeds_json(compiler, tokenizer):
    compact = {**CITY, "x-guidance": {"whitespace_flexible": False}}
    lark = f'start: "city: " obj\nobj: %json {json.dumps(compact)}\n'
    texts = walks(compiler, tokenizer, GrammarSpec("lark", text=lark), steps=40)
    for text in texts:
        assert text.startswith("city: ")
        jsonschema.validate(json.loads(text[len("city: ") :]), CITY)


def test_gbnf_is_translated(compiler, tokenizer):
    gbnf = 'root ::= greeting " " name\ngreeting ::= "hi" | "hello"\nname ::= [A-Z] [a-z]{1,5}\n'
    for spec in (GrammarSpec("gbnf", text=gbnf), GrammarSpec("lark", text=gbnf)):  # Lark takes GBNF too
        for text in walks(compiler, tokenizer, spec):
            assert re.fullmatch(r"(hi|hello) [A-Z][a-z]{1,5}", text), text


TAG = {
    "structures": [
        {"begin": "<function=weather>", "schema": CITY, "end": "</function>"},
        {"begin": "<function=time>", "schema": {"type": "object", "properties": {}}, "end": "</function>"},
    ],
    "triggers": ["<function="],
}


def test_structural_tag_constrains_text_after_a_trigger(compiler, tokenizer):
    spec = GrammarSpec("structural_tag", text=json.dumps(TAG))
    call = '<function=weather>{"city":"Oslo","days":3}</function>'
    assert accepts(compiler, tokenizer, spec, "free text, no call at all")
    assert accepts(compiler, tokenizer, spec, f"Let me check. {call} And now: {call} done")
    assert not accepts(compiler, tokenizer, spec, 'Let me check. <function=weather>{"city":"Rome","days":3}')
    assert not accepts(compiler, tokenizer, spec, "<function=rain>{}</function>")
    assert not accepts(compiler, tokenizer, spec, '<function=weather>{"city":"Oslo","days":3} and on')


def test_structural_tag_walk_through_a_structure(compiler, tokenizer):
    """Once the trigger is written, every walk completes one of the structures."""
    spec = GrammarSpec("structural_tag", text=json.dumps(TAG))
    source = compiler.validate(spec)
    rng = random.Random(3)
    completed = 0
    for _ in range(10):
        constraint = compiler.constraint(source)
        for token in tokenizer.encode("Sure: <function="):
            constraint.advance(token)
        tokens, _ = walk(constraint, tokenizer.eos_token_id, rng, steps=40)
        text = "<function=" + tokenizer.decode(tokens)
        match = re.match(r"<function=(weather|time)>(.*?)</function>", text, re.S)
        if match is None:  # the walk ran out of steps inside the structure
            assert "</function>" not in text
            continue
        completed += 1
        arguments = json.loads(match.group(2))
        if match.group(1) == "weather":
            jsonschema.validate(arguments, CITY)
    assert completed


def test_structural_tag_special_token_trigger(compiler, tokenizer):
    """A trigger that is one added token is matched as that token."""
    tag = {
        "structures": [{"begin": "<filename>", "schema": CITY, "end": "<file_sep>"}],
        "triggers": ["<filename>"],
    }
    spec = GrammarSpec("structural_tag", text=json.dumps(tag))
    assert accepts(compiler, tokenizer, spec, 'x <filename>{"city":"Paris","days":1}<file_sep> y')
    assert not accepts(compiler, tokenizer, spec, 'x <filename>{"city":"Rome","days":1}<file_sep>')


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (GrammarSpec("choice", choices=(), param="p"), "choice list is empty"),
        (GrammarSpec("regex", text="[a-z+(", param="p"), "unclosed character class"),
        (GrammarSpec("regex", text="(?=a)b", param="p"), "look-around"),
        (GrammarSpec("regex", text="[^\\x00-\\x{10FFFF}]", param="p"), "allows no output"),
        (GrammarSpec("lark", text="start: foo\n", param="p"), 'unknown name: "foo"'),
        (GrammarSpec("lark", text='start: "a" %json {"type": "nope"}\n', param="p"), "the grammar"),
        (GrammarSpec("gbnf", text='root ::= <[123]> "x"', param="p"), "token references"),
        (GrammarSpec("gbnf", text='root ::= "a" | !<think>', param="p"), "negated token references"),
        (GrammarSpec("gbnf", text="root ::= missing", param="p"), "Rule 'missing' not found"),
        (GrammarSpec("gbnf", text='start ::= "a"', param="p"), "No 'root' rule found"),
        (GrammarSpec("structural_tag", text="{", param="p"), "not valid JSON"),
        (GrammarSpec("structural_tag", text='{"format": {}}', param="p"), "'format' form is not supported"),
        (
            GrammarSpec("structural_tag", text=json.dumps({**TAG, "triggers": ["<tool>"]}), param="p"),
            "does not start with any trigger",
        ),
        (
            GrammarSpec(
                "structural_tag", text=json.dumps({**TAG, "triggers": ["<function=", "<x"]}), param="p"
            ),
            "starts no structure",
        ),
        (
            GrammarSpec(
                "structural_tag",
                text=json.dumps(
                    {"structures": [{"begin": "<f>", "schema": {"$ref": "#/no"}}], "triggers": ["<f>"]}
                ),
                param="p",
            ),
            "the structural tag",
        ),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(compiler, spec, words):
    with pytest.raises(InvalidRequest) as info:
        compiler.validate(spec)
    assert info.value.param == "p"
    assert words in info.value.message


def request_with(fmt: pb.ResponseFormat) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=pb.PromptInput(text="x"), response_format=fmt)


@pytest.mark.parametrize(
    ("fmt", "kind", "param"),
    [
        (pb.ResponseFormat(choice=pb.ChoiceList(choices=["a", "b"])), "choice", "response_format.choice"),
        (pb.ResponseFormat(regex="a+"), "regex", "response_format.regex"),
        (pb.ResponseFormat(lark='start: "a"'), "lark", "response_format.lark"),
        (pb.ResponseFormat(gbnf='root ::= "a"'), "gbnf", "response_format.gbnf"),
        (
            pb.ResponseFormat(structural_tag_json="{}"),
            "structural_tag",
            "response_format.structural_tag_json",
        ),
    ],
)
def test_wire_forms_become_grammar_specs(fmt, kind, param):
    spec = parse_request(request_with(fmt), "m").grammar
    assert spec is not None and spec.kind == kind and spec.param == param


def test_a_forced_call_and_a_grammar_conflict():
    request = pb.GenerateRequest(
        chat=pb.ChatInput(
            messages=[pb.ChatMessage(role="user", content="hi")],
            tools=[pb.Tool(name="f")],
            tool_choice=pb.ToolChoice(mode=pb.ToolChoice.REQUIRED),
        ),
        response_format=pb.ResponseFormat(regex="a"),
    )
    with pytest.raises(InvalidRequest) as info:
        parse_request(request, "m")
    assert info.value.param == "response_format"
