"""Tool and response_format schemas keep their meaning inside the call grammar: ``$defs``,
``definitions``, ``$ref`` and recursion, as pydantic (and openai's ``pydantic_function_tool``) writes them.

Three levels: the embedded schema accepts exactly what the original accepts (checked with
``jsonschema`` on valid and invalid instances), llguidance compiles it with the default model's
tokenizer and accepts / refuses the same texts token by token, and a tiny random model forced to
call such a tool always writes arguments that validate.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from typing import Any

import jsonschema
import llguidance
import openai
import pytest
from pydantic import BaseModel, Field

from sluice.v1 import worker_pb2 as pb
from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.sampling.grammar import GrammarCompiler, GrammarSpec, embed_schema, tool_call_schema
from worker.server import eos_token_ids
from worker.service.convert import parse_request
from worker.types import (
    Finished,
    FinishReason,
    GenerationRequest,
    OutputOptions,
    SamplingOptions,
    ToolCallDelta,
)

# ------------------------------------------------------------ pydantic models


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


class Options(BaseModel):
    verbose: bool
    color: Color


class Node(BaseModel):
    name: str = Field(max_length=4)
    children: list[Node] = Field(default_factory=list, max_length=2)


class Search(BaseModel):
    """Nested (``Options``), enum (``Color``), optional (``limit``) and recursive (``tree``)."""

    query: str = Field(max_length=8)
    options: Options
    limit: int | None = None
    tree: Node | None = None


def other_model() -> type[BaseModel]:
    """A second tool whose ``$defs`` also has an ``Options``, a different one."""

    class Options(BaseModel):
        size: int

    class Other(BaseModel):
        options: Options

    return Other


def tool_parameters(model: type[BaseModel]) -> dict[str, Any]:
    """What openai-python sends as ``parameters`` for this model."""
    params: dict[str, Any] = openai.pydantic_function_tool(model)["function"]["parameters"]
    return params


SEARCH = tool_parameters(Search)
NODE = tool_parameters(Node)
OTHER = tool_parameters(other_model())
# Draft-07 style, and a root self-reference ("#") for recursion.
LEGACY = {
    "definitions": {"Leaf": {"type": "integer", "minimum": 0}},
    "type": "object",
    "properties": {
        "leaf": {"$ref": "#/definitions/Leaf"},
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    },
    "required": ["leaf", "next"],
    "additionalProperties": False,
}

VALID_SEARCH = [
    {"query": "q", "options": {"verbose": True, "color": "red"}, "limit": None, "tree": None},
    {
        "query": "q",
        "options": {"verbose": False, "color": "blue"},
        "limit": 3,
        "tree": {"name": "a", "children": [{"name": "b", "children": [{"name": "c", "children": []}]}]},
    },
]
INVALID_SEARCH = [
    {"query": "q", "options": {"verbose": True, "color": "green"}, "limit": None, "tree": None},
    {"query": "q", "options": {"verbose": "yes", "color": "red"}, "limit": None, "tree": None},
    {"query": "q", "options": {"verbose": True, "color": "red"}, "limit": "3", "tree": None},
    {"query": "q", "options": {"verbose": True, "color": "red"}, "limit": None, "tree": {"name": 1}},
    {
        "query": "q",
        "options": {"verbose": True, "color": "red"},
        "limit": None,
        "tree": {"name": "a", "children": [{"name": "b", "children": [{"children": []}]}]},
    },
]
VALID_LEGACY = [
    {"leaf": 1, "next": None},
    {"leaf": 1, "next": {"leaf": 2, "next": {"leaf": 0, "next": None}}},
]
INVALID_LEGACY = [{"leaf": -1, "next": None}, {"leaf": 1, "next": {"leaf": -2, "next": None}}, {"leaf": 1}]


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


# ------------------------------------------------------------ the schema itself


@pytest.mark.parametrize(
    ("params", "valid", "invalid"),
    [(SEARCH, VALID_SEARCH, INVALID_SEARCH), (LEGACY, VALID_LEGACY, INVALID_LEGACY)],
    ids=["pydantic", "definitions-and-root-ref"],
)
def test_embedded_schema_accepts_exactly_what_the_original_accepts(params, valid, invalid) -> None:
    combined = tool_call_schema((("f", params), ("g", OTHER)))
    jsonschema.Draft202012Validator.check_schema(combined)
    for instance in valid:
        jsonschema.validate(instance, params)
        jsonschema.validate(call("f", instance), combined)
    for instance in invalid:
        assert not jsonschema.Draft202012Validator(params).is_valid(instance)
        assert not jsonschema.Draft202012Validator(combined).is_valid(call("f", instance)), instance
    # The second tool keeps its own "Options".
    jsonschema.validate(call("g", {"options": {"size": 2}}), combined)
    assert not jsonschema.Draft202012Validator(combined).is_valid(call("g", {"options": {"verbose": True}}))


def test_every_local_ref_points_into_the_combined_root() -> None:
    combined = tool_call_schema((("f", SEARCH), ("g", OTHER), ("h", LEGACY)))
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref" and isinstance(v, str))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(combined)
    assert refs
    for ref in refs:
        assert ref.startswith("#/$defs/")
        assert ref.split("/")[2] in combined["$defs"], ref
    # Each tool's definitions get their own names: no tool's "Options" replaces another's.
    # Color, Node, Options of "f"; Options of "g"; Leaf of "h", and a copy of "h" for its "#".
    assert sorted(combined["$defs"]) == [
        "t0_defs_0",
        "t0_defs_1",
        "t0_defs_2",
        "t1_defs_0",
        "t2_definitions_0",
        "t2_root",
    ]


def test_data_that_looks_like_a_ref_is_left_alone() -> None:
    schema = {"type": "object", "properties": {"a": {"const": {"$ref": "#/$defs/x"}}}, "$defs": {"x": {}}}
    embedded = embed_schema(schema, "p_", {})
    assert embedded["properties"]["a"]["const"] == {"$ref": "#/$defs/x"}


def test_remote_refs_are_not_rewritten() -> None:
    schema = {"$ref": "https://example.com/schema.json"}
    assert embed_schema(schema, "p_", {}) == schema


# ------------------------------------------------------------ llguidance, the default tokenizer


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def compiler(loaded) -> GrammarCompiler:
    return GrammarCompiler(loaded.tokenizer, eos_token_ids(loaded.model, loaded.tokenizer))


def accepts(compiler: GrammarCompiler, tokenizer: Any, source: str, text: str) -> bool:
    """Whether the grammar takes ``text`` (as the tokenizer splits it) and may end there."""
    matcher = llguidance.LLMatcher(compiler._tokenizer(), source, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return bool(matcher.is_accepting())


def tool_text(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>\n{body}\n</tool_call>"


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_calls_with_refs_compile_and_match_token_by_token(compiler, loaded, parallel) -> None:
    """The error this replaces: ``failed to compile JSON schema: Pointer '/$defs/Options' does not exist``."""
    spec = GrammarSpec(
        "tool_call", functions=(("search", SEARCH), ("other", OTHER), ("chain", LEGACY)), parallel=parallel
    )
    source = compiler.validate(spec)
    for instance in VALID_SEARCH:
        assert accepts(compiler, loaded.tokenizer, source, tool_text("search", instance)), instance
    for instance in INVALID_SEARCH:
        assert not accepts(compiler, loaded.tokenizer, source, tool_text("search", instance)), instance
    for instance in VALID_LEGACY:
        assert accepts(compiler, loaded.tokenizer, source, tool_text("chain", instance))
    for instance in INVALID_LEGACY:
        assert not accepts(compiler, loaded.tokenizer, source, tool_text("chain", instance))
    assert accepts(compiler, loaded.tokenizer, source, tool_text("other", {"options": {"size": 1}}))
    assert not accepts(compiler, loaded.tokenizer, source, tool_text("other", {"options": {"color": "red"}}))


def test_named_tool_choice_with_refs_compiles(compiler) -> None:
    request = pb.GenerateRequest(
        chat=pb.ChatInput(
            messages=[pb.ChatMessage(role="user", content="find")],
            tools=[pb.Tool(name="search", parameters_json=json.dumps(SEARCH)), pb.Tool(name="node")],
            tool_choice=pb.ToolChoice(function_name="search"),
        )
    )
    parsed = parse_request(request, "m")
    assert parsed.grammar is not None
    compiler.validate(parsed.grammar)


def test_response_format_schemas_with_refs_compile_and_match(compiler, loaded) -> None:
    for schema, valid, invalid in (
        (SEARCH, VALID_SEARCH, INVALID_SEARCH),
        (LEGACY, VALID_LEGACY, INVALID_LEGACY),
    ):
        source = compiler.validate(GrammarSpec("json_schema", schema=schema))
        for instance in valid:
            assert accepts(compiler, loaded.tokenizer, source, json.dumps(instance, separators=(",", ":")))
        for instance in invalid:
            assert not accepts(
                compiler, loaded.tokenizer, source, json.dumps(instance, separators=(",", ":"))
            )


# ------------------------------------------------------------ a random model, forced


def test_random_model_forced_to_call_a_pydantic_tool_writes_valid_arguments(loaded, compiler) -> None:
    engine = Engine(
        ModelRunner(loaded, num_blocks=256, block_size=16),
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        options=EngineOptions(max_running=8),
        grammars=compiler,
    )
    engine.start()
    try:
        source = compiler.validate(
            GrammarSpec("tool_call", functions=(("options", tool_parameters(Options)),))
        )
        request = GenerationRequest(
            "refs",
            (5, 6, 7, 8),
            SamplingOptions(temperature=1.0, seed=4, max_tokens=200, n=4),
            time.monotonic(),
            output=OutputOptions(tool_calls=True),
            grammar=source,
        )

        async def collect() -> list[Any]:
            return [event async for event in engine.submit(request)]

        events = asyncio.run(collect())
    finally:
        engine.stop()
    for choice in range(4):
        finished = next(e for e in events if isinstance(e, Finished) and e.choice_index == choice)
        assert finished.reason is FinishReason.TOOL_CALLS
        deltas = [e for e in events if isinstance(e, ToolCallDelta) and e.choice_index == choice]
        Options.model_validate_json("".join(d.arguments for d in deltas))
