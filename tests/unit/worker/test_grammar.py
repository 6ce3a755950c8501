"""Grammar-constrained decoding: even a tiny random model produces valid calls and JSON."""

from __future__ import annotations

import asyncio
import copy
import json
import random
import time
from types import SimpleNamespace
from typing import Any
from unittest import mock

import jsonschema
import pytest

from sluice.v1 import worker_pb2 as pb
from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.errors import InvalidRequest
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.sampling.grammar import GrammarCompiler, GrammarSpec
from worker.server import eos_token_ids
from worker.service.convert import parse_request
from worker.types import (
    ContentDelta,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputOptions,
    SamplingOptions,
    ToolCallDelta,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}, "price": {"type": "number"}},
                "required": ["name", "price"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
    },
    "required": ["items", "paid"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def compiler(loaded):
    return GrammarCompiler(loaded.tokenizer, eos_token_ids(loaded.model, loaded.tokenizer))


@pytest.fixture
def engine(loaded, compiler):
    eng = Engine(
        ModelRunner(loaded, num_blocks=256, block_size=16),
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        options=EngineOptions(max_running=8),
        grammars=compiler,
    )
    eng.start()
    yield eng
    eng.stop()


def generate(engine: Engine, grammar: str, output: OutputOptions, n: int = 1, seed: int = 0) -> list:
    request = GenerationRequest(
        f"g{random.random()}",
        (5, 6, 7, 8),
        SamplingOptions(temperature=1.0, seed=seed, max_tokens=400, n=n),
        time.monotonic(),
        output=output,
        grammar=grammar,
    )

    async def collect() -> list:
        return [event async for event in engine.submit(request)]

    return asyncio.run(collect())


def test_forced_call_from_a_random_model_always_validates(engine, compiler):
    source = compiler.validate(GrammarSpec("tool_call", functions=(("get_weather", WEATHER),)))
    events = generate(engine, source, OutputOptions(tool_calls=True), n=4, seed=11)
    for choice in range(4):
        deltas = [e for e in events if isinstance(e, ToolCallDelta) and e.choice_index == choice]
        assert deltas[0].name == "get_weather" and deltas[0].call_id.startswith("call_")
        arguments = json.loads("".join(d.arguments for d in deltas))
        jsonschema.validate(arguments, WEATHER)
        finished = next(e for e in events if isinstance(e, Finished) and e.choice_index == choice)
        assert finished.reason is FinishReason.TOOL_CALLS
        assert not [e for e in events if isinstance(e, ContentDelta) and e.choice_index == choice and e.text]


def test_required_picks_one_of_the_tools(engine, compiler):
    time_schema = {
        "type": "object",
        "properties": {"tz": {"enum": ["UTC", "CET"]}},
        "required": ["tz"],
        "additionalProperties": False,
    }
    spec = GrammarSpec("tool_call", functions=(("get_weather", WEATHER), ("get_time", time_schema)))
    events = generate(engine, compiler.validate(spec), OutputOptions(tool_calls=True), n=3, seed=5)
    for choice in range(3):
        deltas = [e for e in events if isinstance(e, ToolCallDelta) and e.choice_index == choice]
        name = deltas[0].name
        jsonschema.validate(
            json.loads("".join(d.arguments for d in deltas)),
            {"get_weather": WEATHER, "get_time": time_schema}[name],
        )


def test_json_schema_output_always_validates(engine, compiler):
    source = compiler.validate(GrammarSpec("json_schema", schema=ORDER))
    events = generate(engine, source, OutputOptions(), n=4, seed=3)
    for choice in range(4):
        text = "".join(e.text for e in events if isinstance(e, ContentDelta) and e.choice_index == choice)
        jsonschema.validate(json.loads(text), ORDER)


def test_json_object_output_is_an_object(engine, compiler):
    events = generate(engine, compiler.validate(GrammarSpec("json_object")), OutputOptions(), seed=9)
    text = "".join(e.text for e in events if isinstance(e, ContentDelta))
    finished = next(e for e in events if isinstance(e, Finished))
    if finished.reason is not FinishReason.LENGTH:  # a random model may write a long object
        assert isinstance(json.loads(text), dict)


def test_an_unusable_schema_is_refused_naming_the_field(compiler):
    with pytest.raises(InvalidRequest) as info:
        compiler.validate(
            GrammarSpec(
                "json_schema",
                schema={"type": "object", "properties": {"a": {"$ref": "#/no"}}},
                param="response_format.json_schema.schema",
            )
        )
    assert info.value.param == "response_format.json_schema.schema"


def chat_with_tools(**chat) -> pb.GenerateRequest:
    tool = pb.Tool(name="get_weather", parameters_json=json.dumps(WEATHER))
    return pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")], tools=[tool], **chat)
    )


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (chat_with_tools(tool_choice=pb.ToolChoice(function_name="nope")), "tool_choice"),
        (
            pb.GenerateRequest(
                chat=pb.ChatInput(
                    messages=[pb.ChatMessage(role="user", content="hi")],
                    tool_choice=pb.ToolChoice(mode=pb.ToolChoice.REQUIRED),
                )
            ),
            "tool_choice",
        ),
        (
            pb.GenerateRequest(
                chat=pb.ChatInput(
                    messages=[pb.ChatMessage(role="user", content="hi")],
                    tools=[pb.Tool(name="f", parameters_json="{not json")],
                )
            ),
            "tools[0].function.parameters",
        ),
        (
            pb.GenerateRequest(
                chat=pb.ChatInput(
                    messages=[pb.ChatMessage(role="user", content="hi")],
                    tools=[pb.Tool(name="f"), pb.Tool(name="f")],
                )
            ),
            "tools[1].function.name",
        ),
        (
            pb.GenerateRequest(
                chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")]),
                response_format=pb.ResponseFormat(json_schema=pb.JsonSchema(name="x")),
            ),
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_tool_and_format_fields_are_named(request_, param):
    with pytest.raises(InvalidRequest) as info:
        parse_request(request_, "m")
    assert info.value.param == param


def test_tool_choice_modes():
    auto = parse_request(chat_with_tools(), "m")
    assert auto.parse_tool_calls and auto.grammar is None and auto.prompt.tools
    none = parse_request(chat_with_tools(tool_choice=pb.ToolChoice(mode=pb.ToolChoice.NONE)), "m")
    assert not none.parse_tool_calls and none.grammar is None and not none.prompt.tools
    named = parse_request(chat_with_tools(tool_choice=pb.ToolChoice(function_name="get_weather")), "m")
    assert (
        named.grammar is not None
        and named.grammar.kind == "tool_call"
        and named.prompt.forced_tool == "get_weather"
    )


def test_the_token_table_is_llguidances_own_without_the_copy(loaded: Any) -> None:
    """Read straight from the tokenizer, the table equals llguidance's helper's; a tokenizer set to
    pad goes through the helper, which copies it, and keeps its padding."""
    import llguidance.hf

    from worker.sampling.grammar import _ll_tokenizer

    tokenizer = loaded.tokenizer
    eos = [tokenizer.eos_token_id]
    direct = _ll_tokenizer(tokenizer, len(tokenizer), eos)
    helper = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=eos[0])
    text = 'Hello, world! {"a": [1, 2]} \u00e9t\u00e9'
    assert direct.tokenize_str(text) == helper.tokenize_str(text)
    assert direct.vocab_size == helper.vocab_size and direct.eos_token == helper.eos_token
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.enable_padding(length=8)
    padded = SimpleNamespace(backend_tokenizer=backend, eos_token_id=eos[0])
    with mock.patch("llguidance.hf.from_tokenizer", return_value="helper") as helper_call:
        assert _ll_tokenizer(padded, len(tokenizer), eos) == "helper"
    helper_call.assert_called_once()
    assert backend.padding is not None
