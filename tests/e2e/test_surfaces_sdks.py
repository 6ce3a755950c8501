"""The Responses, Anthropic Messages and native surfaces with their real clients, against a real
edge and worker serving the default model: openai-python's Responses API (create, stream=True, the
stream() helper), the openai Node SDK's, the anthropic SDK (create, stream(), tool use), LangChain's
ChatAnthropic, and httpx reading the native event stream.

Greedy decoding (temperature 0) makes a streamed answer comparable with the non-streamed one. The
question's greedy answer is one short sentence that ends on its own (openai-python's stream helper
only assembles a final Response from `response.completed`, which an answer cut by
max_output_tokens does not send). The small default model never calls a tool on its own, so tool
calls are forced with a tool choice. Token counts are kept small: each token costs real time on a CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.e2e.test_other_clients import node_sdk  # noqa: F401  (the pytest fixture)

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France? Answer in one sentence."
# Room for the whole greedy answer ("The capital of France is Paris.", 8 tokens with its end).
LIMIT = 16
# A forced call waits for its grammar before its first token; on a loaded two-core machine that
# silence can pass the edge's default idle timeout, so the tool tests allow more.
PATIENT = {"X-Sluice-Idle-Timeout": "600"}
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def responses_client(default_edge) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_edge.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(default_edge) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=default_edge.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def greedy_text(responses_client) -> str:
    """The chat completions answer at temperature 0: every surface must reproduce it."""
    chat = responses_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=LIMIT
    )
    assert chat.choices[0].finish_reason == "stop"
    return chat.choices[0].message.content or ""


def _without_ids(response: Any) -> dict[str, Any]:
    """A Response as a dict without what differs between two calls (ids, time, cache hits)."""
    # exclude_none: the stream helper adds `parsed: None` to text parts (no text_format asked).
    dumped = response.model_dump(exclude={"id", "created_at"}, exclude_none=True)
    for item in dumped["output"]:
        item.pop("id", None)
    dumped["usage"]["input_tokens_details"].pop("cached_tokens")
    return dumped


# ---------------------------------------------------------------- Responses


def test_responses_streamed_equals_non_streamed(responses_client, greedy_text):
    settings = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": LIMIT}
    whole = responses_client.responses.create(**settings)
    assert whole.output_text == greedy_text
    assert whole.status == "completed" and whole.incomplete_details is None
    assert 0 < whole.usage.output_tokens < LIMIT and whole.usage.output_tokens_details.reasoning_tokens == 0

    events = list(responses_client.responses.create(**settings, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == greedy_text

    with responses_client.responses.stream(**settings) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == greedy_text
    assert _without_ids(final) == _without_ids(whole)

    # An answer cut by max_output_tokens ends with response.incomplete.
    cut = responses_client.responses.create(**{**settings, "max_output_tokens": 2})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2


def test_responses_forced_tool_call_and_its_output_sent_back(responses_client):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_SCHEMA,
            "strict": True,
        }
    ]
    with responses_client.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=40,
        extra_headers=PATIENT,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}

    answer = responses_client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            *[item.model_dump(exclude_none=True) for item in final.output],
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 25 C"},
        ],
        tools=tools,
        temperature=0,
        max_output_tokens=3,
    )
    assert answer.output_text and answer.usage.output_tokens == 3


def test_responses_unknown_previous_response_is_a_400(responses_client):
    with pytest.raises(openai.BadRequestError) as caught:
        responses_client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert caught.value.param == "previous_response_id" and caught.value.code == "previous_response_not_found"


def test_node_sdk_responses(node_sdk, default_edge, greedy_text):  # noqa: F811
    done = subprocess.run(
        ["node", "responses.mjs"],
        cwd=node_sdk,
        env={**os.environ, "SLUICE_BASE_URL": f"{default_edge.base_url}/v1", "SLUICE_MODEL": MODEL},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["create"]["object"] == "response" and seen["create"]["text"] == greedy_text
    assert seen["create"]["status"] == "completed"
    assert seen["stream"]["text"] == greedy_text
    assert seen["stream"]["types"][0] == "response.created"
    assert seen["stream"]["types"][-1] == "response.completed"
    assert seen["helper"]["deltas"] == seen["helper"]["text"] == greedy_text
    assert seen["helper"]["usage"] == seen["create"]["usage"]
    assert seen["stateful"] == {"class": "BadRequestError", "status": 400, "param": "previous_response_id"}


# ---------------------------------------------------------------- Anthropic


def test_anthropic_streamed_equals_non_streamed(anthropic_client, greedy_text):
    settings: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": LIMIT,
        "messages": [{"role": "user", "content": QUESTION}],
        # The SDK has no sampling arguments: they travel as extra body fields.
        "extra_body": {"temperature": 0},
    }
    whole = anthropic_client.messages.create(**settings)
    assert [block.type for block in whole.content] == ["text"]
    assert whole.content[0].text == greedy_text
    assert whole.stop_reason == "end_turn" and 0 < whole.usage.output_tokens < LIMIT

    with anthropic_client.messages.stream(**settings) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == greedy_text
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.stop_sequence, final.model) == (whole.stop_reason, None, whole.model)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert (
        final.usage.input_tokens + final.usage.cache_read_input_tokens
        == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )

    # top_k=1 leaves one candidate per step: greedy whatever the temperature, if top_k is honoured.
    sampled = anthropic_client.messages.create(
        **{**settings, "extra_body": {"temperature": 1.5 / 2, "top_k": 1, "top_p": 1.0}}
    )
    assert sampled.content[0].text == greedy_text


def test_anthropic_forced_tool_use_is_parsed_by_the_sdk(anthropic_client):
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}]
    with anthropic_client.messages.stream(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
        extra_headers=PATIENT,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    uses = [block for block in final.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert set(uses[0].input) == {"city"} and isinstance(uses[0].input["city"], str)
    assert final.stop_reason == "tool_use"

    # The tool's result goes back as a tool_result block.
    answer = anthropic_client.messages.create(
        model=MODEL,
        max_tokens=3,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": [block.model_dump(exclude_none=True) for block in final.content],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny"}],
            },
        ],
        tools=tools,
        extra_body={"temperature": 0},
    )
    assert answer.content and answer.usage.output_tokens == 3


def test_anthropic_errors_are_anthropic_errors(anthropic_client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(
            model=MODEL,
            max_tokens=5,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"temperature": 3},
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.messages.create(
            model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )


def test_langchain_chat_anthropic(default_edge, greedy_text):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(
        base_url=default_edge.base_url,
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=LIMIT,
        max_retries=0,
    )
    message = llm.invoke(QUESTION)
    assert message.content == greedy_text
    assert message.usage_metadata is not None and 0 < message.usage_metadata["output_tokens"] < LIMIT
    assert message.response_metadata["stop_reason"] == "end_turn"

    pieces = list(llm.stream(QUESTION))
    whole = pieces[0]
    for piece in pieces[1:]:
        whole += piece
    assert whole.text == greedy_text


# ------------------------------------------------------------------- native


def _native_events(raw: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for frame in raw.split("\n\n"):
        if frame and not frame.startswith(":"):
            name, data = frame.split("\n")
            events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_native_stream_and_body(default_edge, greedy_text):
    body = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": LIMIT}
    with httpx.Client(base_url=default_edge.base_url, timeout=120) as client:
        whole = client.post("/api/v1/chat", json=body).json()
        streamed = client.post("/api/v1/chat", json={**body, "stream": True})
        models = client.get("/api/v1/models").json()
    assert whole["output"] == [{"type": "message", "content": greedy_text}]
    assert 0 < whole["stats"]["total_output_tokens"] < LIMIT and whole["stop_reason"] == "stop"
    assert whole["stats"]["input_tokens"] > 0 and whole["stats"]["tokens_per_second"] > 0
    events = _native_events(streamed.text)
    names = [name for name, _ in events]
    assert names[:2] == ["chat.start", "prompt_processing.start"]
    assert names.index("prompt_processing.end") < names.index("message.start")
    assert names[-3:] == ["message.delta", "message.end", "chat.end"]
    assert "".join(e["content"] for n, e in events if n == "message.delta") == greedy_text
    result = events[-1][1]["result"]
    assert result["output"] == whole["output"] and result["model_instance_id"] == MODEL
    assert models["models"][0]["key"] == MODEL
