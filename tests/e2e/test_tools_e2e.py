"""Tool calls, structured outputs and refusals end to end: the official openai SDK (and LangChain)
against a real edge and worker serving the default model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.json_prefix import is_json_prefix
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
FORCE = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(default_edge) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_edge.base_url}/v1", api_key="unused", max_retries=0, timeout=180)


def test_streamed_named_tool_call_has_openai_shape_and_valid_arguments(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=FORCE,
            stream=True,
            max_tokens=120,
            temperature=0,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas, "no tool-call deltas"
    assert all(d.index == 0 and d.function is not None for d in deltas)
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert all(d.id is None and d.type is None and d.function.name is None for d in rest)
    arguments = json.loads("".join(d.function.arguments or "" for d in deltas))
    jsonschema.validate(arguments, WEATHER)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


def test_stream_helper_accumulates_the_call(client):
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=FORCE, max_tokens=120, temperature=0
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert final.choices[0].finish_reason == "tool_calls"


def test_required_and_non_streaming(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_follow_up_turn_with_tool_results_renders(client):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0
    )
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


class Order(BaseModel):
    dish: str
    quantity: int
    spicy: bool


def test_json_schema_response_parses_into_a_model(client):
    completion = client.chat.completions.parse(
        model=MODEL,
        max_tokens=200,
        temperature=0,
        messages=[{"role": "user", "content": "Order two spicy curries, as JSON."}],
        response_format=Order,
    )
    order = completion.choices[0].message.parsed
    assert isinstance(order, Order)


def test_json_object_response_is_a_json_object(client):
    reply = client.chat.completions.create(
        model=MODEL,
        max_tokens=64,  # valid JSON or a valid JSON prefix either way (checked below)
        temperature=0,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
    )
    # The grammar guarantees a JSON object, not that the model closes it within max_tokens.
    content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert finish in ("stop", "length") and content.lstrip().startswith("{")
    assert is_json_prefix(content)
    if finish == "stop":
        assert isinstance(json.loads(content), dict)


def test_langchain_merges_streamed_tool_call_chunks(default_edge):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{default_edge.base_url}/v1",
        api_key="unused",
        model=MODEL,
        max_tokens=120,
        temperature=0,
        stream_usage=True,
    )
    bound = llm.bind_tools([TOOLS[0]], tool_choice="get_weather")
    gathered = None
    for chunk in bound.stream("What is the weather in Paris, in celsius?"):
        gathered = chunk if gathered is None else gathered + chunk
    assert gathered is not None and gathered.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(gathered.tool_calls[0]["args"], WEATHER)
    assert gathered.usage_metadata and gathered.usage_metadata["output_tokens"] > 0


# A --fake-tokens worker streams a fixed passage (worker/model/fake_runner.py) whatever the prompt:
# the content rule's path does not depend on the model, and no model loads or runs.
BLOCKED = "old mill"


@pytest.fixture(scope="module")
def filtering_edge(model_cache, tmp_path_factory):
    """A ``--fake-tokens`` worker whose content rule blocks a phrase of the passage it streams."""
    logs = tmp_path_factory.mktemp("filtering")
    refusal = ["--refusal-message", "I can't talk about that city."]
    extra = ["--fake-tokens", "--blocked-phrases", BLOCKED, *refusal]
    with (
        WorkerProcess(cache_dir=model_cache, log_dir=logs, extra=extra) as worker,
        EdgeProcess([worker.address], log_dir=logs) as edge,
    ):
        yield edge


def test_refusal_and_content_filter_reach_the_sdk(filtering_edge):
    client = openai.OpenAI(
        base_url=f"{filtering_edge.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    ask = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=20, stream=True)
    )
    refusal = "".join(c.choices[0].delta.refusal or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert refusal == "I can't talk about that city." and BLOCKED not in content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "content_filter"
    ]
    reply = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=20)
    assert reply.choices[0].finish_reason == "content_filter"
    assert reply.choices[0].message.refusal == "I can't talk about that city."


def test_raw_tool_call_chunks_carry_index_and_function(default_edge):
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": FORCE,
        "stream": True,
        "max_tokens": 120,
        "temperature": 0,
    }
    with httpx.stream(
        "POST", f"{default_edge.base_url}/v1/chat/completions", json=body, timeout=180
    ) as response:
        lines = [
            line for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
    calls = [
        tc
        for line in lines
        for ch in json.loads(line[6:])["choices"]
        for tc in ch["delta"].get("tool_calls", [])
    ]
    assert calls and all(isinstance(tc["index"], int) and "function" in tc for tc in calls)
    assert calls[0]["type"] == "function" and calls[0]["id"] and calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in tc and "name" not in tc["function"] for tc in calls[1:])
