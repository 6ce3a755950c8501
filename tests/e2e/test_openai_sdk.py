"""The official openai Python SDK against a real edge and worker serving the default model: chat.

Every request generates only a few tokens (the suite runs on two cores).
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from worker.config import WorkerConfig

pytestmark = pytest.mark.e2e

BLOCK_TOKENS = WorkerConfig().kv_block_size

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(default_edge) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_edge.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def sse_lines(edge, body: dict) -> tuple[httpx.Response, list[str]]:
    with httpx.stream("POST", f"{edge.base_url}/v1/chat/completions", json=body, timeout=120) as response:
        lines = list(response.iter_lines())
    return response, lines


def test_models_lists_the_default_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_streaming_matches_non_streaming_at_temperature_zero(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_max_tokens_gives_length(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, stream=True
        )
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_stop_string_never_appears(client):
    messages = [{"role": "user", "content": "List the numbers from 1 to 20 separated by commas."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    text = full.choices[0].message.content
    stop = "4"
    assert stop in text
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=12,
            stop=[stop, "never-seen"],
            stream=stream,
        )
        if stream:
            chunks = list(reply)
            out = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        else:
            out, finish = reply.choices[0].message.content, [reply.choices[0].finish_reason]
        assert stop not in out and text.startswith(out)
        assert finish == ["stop"]


def test_raw_sse_wire_format(default_edge):
    response, lines = sse_lines(
        default_edge,
        {"model": MODEL, "messages": QUESTION, "stream": True, "max_tokens": 4, "temperature": 0},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-request-id"] and response.headers["x-sluice-worker-id"]
    events = [line for line in lines if line]
    assert all(line.startswith("data: ") for line in events), "no event:/id: lines on a normal stream"
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("content" in c["choices"][0]["delta"] for c in chunks[1:-1])
    for chunk in chunks:
        assert {"id", "object", "created", "model", "system_fingerprint", "choices"} <= chunk.keys()


def test_request_id_is_echoed(default_edge):
    response = httpx.post(
        f"{default_edge.base_url}/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 2},
        headers={"X-Request-ID": "my-trace-123"},
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == "my-trace-123"
    assert response.headers["content-type"].startswith("application/json")


def test_errors_map_to_sdk_exceptions(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=7)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert "role" in (bad.value.param or "")
    with pytest.raises(openai.BadRequestError) as bad:  # too long for the context: the worker's check
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 9000}])
    assert bad.value.param == "messages"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.BadRequestError):  # a streaming request fails before any chunk
        list(client.chat.completions.create(model=MODEL, messages=[], stream=True))


def test_breaking_out_of_a_stream_cancels_the_worker(client, default_worker):
    before = default_worker.metrics()
    stream = client.chat.completions.create(
        model=MODEL,
        stream=True,
        max_tokens=2000,
        messages=[{"role": "user", "content": "Write a very long story about a dragon and a knight."}],
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = default_worker.metrics()
        if now["sluice_worker_requests_cancelled_total"] > before["sluice_worker_requests_cancelled_total"]:
            break
        time.sleep(0.05)
    assert (
        now["sluice_worker_requests_cancelled_total"] == before["sluice_worker_requests_cancelled_total"] + 1
    )
    assert now["sluice_worker_running_sequences"] == 0
    generated = now["sluice_worker_generated_tokens_total"] - before["sluice_worker_generated_tokens_total"]
    assert generated < 50, f"{generated} tokens generated after the client left at 3"


# ------------------------------------------------------------ chat features

SHORT = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 5}


@pytest.fixture(scope="module")
def reference(client) -> openai.types.chat.ChatCompletion:
    """The greedy non-streaming answer to SHORT, with logprobs: what the other forms must equal."""
    return client.chat.completions.create(**SHORT, logprobs=True, top_logprobs=3)


def test_stream_helper_and_final_completion(client, reference):
    # The helper refuses a "length" ending (LengthFinishReasonError): end on a stop string instead.
    deltas, kinds = [], set()
    with client.chat.completions.stream(**{**SHORT, "max_tokens": 8}, stop=[" France"]) as stream:
        for event in stream:
            kinds.add(event.type)
            if event.type == "content.delta":
                deltas.append(event.delta)
        final = stream.get_final_completion()
    assert {"chunk", "content.delta", "content.done"} <= kinds
    text = reference.choices[0].message.content
    assert " France" in text  # the greedy answer goes on past the stop string
    expected = text[: text.index(" France")]
    assert "".join(deltas) == expected and final.choices[0].message.content == expected
    assert final.choices[0].finish_reason == "stop" and final.usage is None


def test_logprobs_once_per_token_in_both_modes(client, reference):
    choice = reference.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == reference.usage.completion_tokens  # finish "length": no EOS among them
    assert b"".join(bytes(e.bytes) for e in entries).decode() == choice.message.content
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        best = entry.top_logprobs[0]
        # Greedy: the chosen token is the most likely one, and the alternatives are sorted.
        assert (best.token, best.logprob) == (entry.token, entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )

    streamed = []
    for chunk in client.chat.completions.create(**SHORT, logprobs=True, top_logprobs=3, stream=True):
        for c in chunk.choices:
            if c.delta.content:
                streamed.extend(c.logprobs.content)
                assert b"".join(bytes(e.bytes) for e in c.logprobs.content).decode() == c.delta.content
            elif c.logprobs is not None:
                assert not c.logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in entries
    ]
    without = client.chat.completions.create(**SHORT)
    assert without.choices[0].logprobs is None


def test_usage_chunk_and_continuous_usage(client, reference):
    client.chat.completions.create(**SHORT)  # so the prompt's whole blocks are in the prefix cache
    chunks = list(
        client.chat.completions.create(
            **SHORT, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
        )
    )
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == reference.usage.completion_tokens
    assert final.usage.prompt_tokens == reference.usage.prompt_tokens
    # The worker reuses every whole cached block of the prompt but always computes its last token.
    cached = (final.usage.prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert final.usage.prompt_tokens_details.cached_tokens == cached > 0
    assert final.usage.completion_tokens_details.reasoning_tokens == 0
    running = [c.usage.completion_tokens for c in chunks[:-1]]
    assert running[0] == 0 and running == sorted(running) and running[-1] == final.usage.completion_tokens
    assert all(c.usage.prompt_tokens == final.usage.prompt_tokens for c in chunks)
    # Every content chunk carries new tokens, so the count rises with each one (by one per token, or
    # by several where the worker merged the tokens of several steps into one delta).
    content_counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].delta.content]
    assert content_counts[0] >= 1 and content_counts == sorted(set(content_counts))  # strictly rising
    assert content_counts[-1] <= final.usage.completion_tokens


def test_n_choices_stream_in_openai_order(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, n=3, max_tokens=3, temperature=1, seed=7, stream=True
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1, 2] and [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]
    finishes = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finishes == [0, 1, 2]
    for index in range(3):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason is not None
    whole = client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=3, max_tokens=3, temperature=1, seed=7
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert 3 <= whole.usage.completion_tokens <= 9  # 3 choices of 1 to 3 tokens
    # Seeded: the same request gives the same choices, streamed or not.
    streamed = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in range(3)
    ]
    assert streamed == [c.message.content for c in whole.choices]


def test_every_message_role_and_sampling_field_is_accepted(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": [{"type": "text", "text": "Answer in English."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is the weather"},
                    {"type": "text", "text": "in Paris?"},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
        temperature=0.5,
        top_p=0.9,
        seed=1,
        stop=["\n\n", "###"],
        max_completion_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="e2e-user",
        metadata={"suite": "e2e"},
        parallel_tool_calls=False,
        response_format={"type": "text"},
    )
    assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens <= 2


def test_logit_bias_is_honoured(client, reference, tokenizer):
    first = reference.choices[0].logprobs.content[0].token
    (token_id,) = tokenizer.encode(first, add_special_tokens=False)
    biased = client.chat.completions.create(
        **{**SHORT, "max_tokens": 1}, logprobs=True, logit_bias={str(token_id): -100}
    )
    assert biased.choices[0].logprobs.content[0].token != first


def test_worker_refusals_reach_the_client_with_their_param(client):
    # Only the worker knows how long the rendered prompt is: max_tokens past the context is its
    # refusal, after the edge's own checks passed. n past the contract's limit is the edge's.
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**{**SHORT, "max_tokens": 10**6}, stream=stream)
        assert caught.value.param == "max_tokens" and caught.value.code == "invalid_parameter"
        assert "context length" in str(caught.value)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**SHORT, n=17, stream=stream)
        assert caught.value.param == "n"


def test_vllm_extensions_ignore_eos_and_min_tokens(client):
    say = [{"role": "user", "content": "Reply with the single word: hi"}]
    short = client.chat.completions.create(model=MODEL, messages=say, max_tokens=40, temperature=0)
    assert short.usage.completion_tokens < 40  # the model ends on its own
    forced = client.chat.completions.create(
        model=MODEL, messages=say, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert forced.usage.completion_tokens == 40 and forced.choices[0].finish_reason == "length"
    longer = client.chat.completions.create(
        model=MODEL,
        messages=say,
        max_tokens=40,
        temperature=0,
        extra_body={"min_tokens": short.usage.completion_tokens + 5},
    )
    assert longer.usage.completion_tokens >= short.usage.completion_tokens + 5
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=say, max_tokens=4, extra_body={"min_tokens": 9})
    assert "min_tokens" in str(caught.value)
