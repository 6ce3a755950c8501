"""The tokenizer routes against a real edge and worker serving the default model: ``/tokenize`` round
trips through ``/detokenize`` (text and chat), a chat's count is what a generation reports as its
prompt tokens (chat completions, and Anthropic's ``count_tokens`` through the anthropic SDK with
system, tools and tool blocks), and fill-in-the-middle is refused naming the field, since SmolLM2's
vocabulary has no FIM tokens (tests/integration/test_families_e2e.py serves a model that has them).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import httpx
import openai
import pytest

from sluice.client import WorkerClient
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
TEXT = "Sluice counts tokens: naïve café, 東京, 42 * 7 = 294."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]


def post(edge: EdgeProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{edge.base_url}{path}", json=body, timeout=120)


@pytest.fixture(scope="module")
def context_length(default_worker: WorkerProcess) -> int:
    async def ask() -> int:
        async with WorkerClient(default_worker.address) as client:
            return (await client.list_models()).models[0].context_length

    return asyncio.run(ask())


def test_text_round_trips_with_count_and_context_length(
    default_edge: EdgeProcess, context_length: int
) -> None:
    tokenized = post(default_edge, "/tokenize", {"model": MODEL, "prompt": TEXT, "return_token_strs": True})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 5
    assert body["max_model_len"] == context_length
    assert tokenized.headers["x-sluice-worker-id"]
    back = post(default_edge, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


def test_chat_round_trips_and_counts_what_generation_reports(
    default_edge: EdgeProcess, tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": "Say hi."}]
    tokenized = post(default_edge, "/tokenize", {"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    back = post(default_edge, "/detokenize", {"tokens": tokenized["tokens"]}).json()
    assert back["prompt"] == rendered
    without = post(default_edge, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert (
        without["tokens"] == tokenized["tokens"][: without["count"]] and without["count"] < tokenized["count"]
    )

    client = openai.OpenAI(base_url=f"{default_edge.base_url}/v1", api_key="unused", max_retries=0)
    for body in (
        {"messages": messages},
        {"messages": CONVERSATION, "tools": [WEATHER]},
        {"messages": CONVERSATION[:2], "tools": [WEATHER], "tool_choice": "none"},
    ):
        counted = post(default_edge, "/tokenize", body).json()["count"]
        completion = client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, **body)
        assert completion.usage is not None and completion.usage.prompt_tokens == counted, body


def test_anthropic_sdk_count_tokens_equals_the_messages_input_tokens(default_edge: EdgeProcess) -> None:
    client = anthropic.Anthropic(base_url=default_edge.base_url, api_key="unused", max_retries=0)
    tools: list[Any] = [
        {
            "name": "get_weather",
            "description": "Weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "tu_1", "name": "get_weather", "input": {"city": "Paris"}}
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "Sunny"}]},
    ]
    system = "You answer briefly."
    counted = client.messages.count_tokens(model=MODEL, system=system, tools=tools, messages=messages)
    created = client.messages.create(model=MODEL, max_tokens=1, system=system, tools=tools, messages=messages)
    # Anthropic's input_tokens leaves out the prompt tokens served from the prefix cache.
    prompt_tokens = created.usage.input_tokens + (created.usage.cache_read_input_tokens or 0)
    assert counted.input_tokens == prompt_tokens > 20
    bare = client.messages.count_tokens(model=MODEL, messages=messages[:1])
    assert bare.input_tokens < counted.input_tokens  # the system prompt and the tools count
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.count_tokens(model=MODEL, messages=[])
    assert raised.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_bad_tokenizer_input_is_a_400_naming_the_field(default_edge: EdgeProcess) -> None:
    for path, body, param in (
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens[1]"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),  # past the vocabulary: the worker's check
    ):
        answer = post(default_edge, path, body)
        assert answer.status_code in (400, 404), (path, body, answer.text)
        assert answer.json()["error"]["param"] == param, answer.text


def test_suffix_and_infill_are_refused_naming_the_field_without_fim_tokens(default_edge: EdgeProcess) -> None:
    client = openai.OpenAI(base_url=f"{default_edge.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="def add(a, b):", suffix="\n", max_tokens=2)
    assert raised.value.body["param"] == "suffix"  # type: ignore[index]
    assert "fill-in-the-middle" in raised.value.body["message"]  # type: ignore[index]
    infill = post(
        default_edge, "/infill", {"input_prefix": "def add(a, b):", "input_suffix": "\n", "n_predict": 2}
    )
    assert infill.status_code == 400 and infill.json()["error"]["param"] == "input_suffix"
    assert infill.headers["x-sluice-worker-id"]
    # Without a suffix /infill is a plain completion of the prefix, in llama.cpp's answer.
    plain = post(
        default_edge, "/infill", {"input_prefix": "def add(a, b):", "n_predict": 2, "temperature": 0}
    )
    assert plain.status_code == 200, plain.text
    answer = plain.json()
    assert answer["stop"] is True and answer["tokens_predicted"] <= 2 and answer["tokens_evaluated"] > 0
    assert answer["stop_type"] in ("eos", "limit") and isinstance(answer["content"], str)
