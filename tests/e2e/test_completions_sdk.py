"""The official openai Python SDK's ``completions`` against a real edge and worker (default model).

Greedy (temperature 0) answers are compared across forms: a string prompt, its token ids, a
list of prompts with n choices, streamed or not, must all give the same text.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "One, two, three,"]
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 4}


@pytest.fixture(scope="module")
def float_edge(
    float_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EdgeProcess]:
    """The default model pinned to float32: these tests compare a 4-row batch's greedy text with one
    row's, and a quantized worker multiplies 1-3 rows and 4+ rows with different kernels (the same
    weights, rounded differently: docs/quantization.md), so a near-tie could pick another token."""
    with EdgeProcess([float_worker.address], log_dir=tmp_path_factory.mktemp("float-logs")) as edge:
        yield edge


@pytest.fixture(scope="module")
def client(float_edge: EdgeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{float_edge.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(client) -> list[str]:
    """The greedy continuation of each prompt, asked one prompt at a time."""
    texts = []
    for prompt in PROMPTS:
        reply = client.completions.create(prompt=prompt, **GREEDY)
        assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + 4
        texts.append(reply.choices[0].text)
    assert all(texts) and texts[0] != texts[1]
    return texts


def test_streaming_equals_non_streaming(client, reference):
    chunks = list(
        client.completions.create(
            prompt=PROMPTS[0], stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[0]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_prompts_and_n_give_k_times_n_choices_in_order(client, reference):
    reply = client.completions.create(prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [reference[0], reference[0], reference[1], reference[1]]
    assert reply.usage.completion_tokens == 16
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in client.completions.create(prompt=PROMPTS, n=2, stream=True, **GREEDY):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {i: c.text for i, c in enumerate(reply.choices)}
    assert finishes == {i: ["length"] for i in range(4)}


def test_token_id_prompts_match_text_prompts(client, reference, tokenizer):
    ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    single = client.completions.create(prompt=ids[0], **GREEDY)
    assert single.choices[0].text == reference[0]
    several = client.completions.create(prompt=ids, **GREEDY)
    assert [c.text for c in several.choices] == reference
    echoed = client.completions.create(prompt=ids[1], echo=True, **GREEDY)
    assert echoed.choices[0].text == tokenizer.decode(ids[1]) + reference[1]


def test_echo_prepends_the_prompt_in_both_modes(client, reference):
    reply = client.completions.create(prompt=PROMPTS[0], echo=True, **GREEDY)
    assert reply.choices[0].text == PROMPTS[0] + reference[0]
    streamed = list(client.completions.create(prompt=PROMPTS[0], echo=True, stream=True, **GREEDY))
    assert streamed[0].choices[0].text == PROMPTS[0]
    assert "".join(c.choices[0].text for c in streamed) == PROMPTS[0] + reference[0]


def test_legacy_logprobs(client, reference):
    reply = client.completions.create(prompt=PROMPTS[0], logprobs=2, **GREEDY)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert choice.text == reference[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == choice.text  # plain ASCII here: token texts concatenate to the text
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert lp.text_offset == offsets
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and token in top and 1 <= len(top) <= 3
        assert top[token] == logprob == max(top.values())  # greedy picks the most likely token
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(prompt=PROMPTS[0], logprobs=2, stream=True, **GREEDY)
        if c.choices[0].text
    ]
    assert [t for part in streamed for t in part.tokens] == lp.tokens
    assert [o for part in streamed for o in part.text_offset] == lp.text_offset
    assert client.completions.create(prompt=PROMPTS[0], **GREEDY).choices[0].logprobs is None


def test_default_max_tokens_is_16_and_stop_strings(client):
    reply = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0)
    text = reply.choices[0].text
    assert reply.usage.completion_tokens <= 16
    if reply.choices[0].finish_reason == "length":
        assert reply.usage.completion_tokens == 16
    assert " 7" in text  # the greedy continuation counts on
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(" 7")]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"suffix": "and that is all."}, "suffix"),  # the default model has no FIM tokens: the worker says
        ({"best_of": 2}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),  # 0 only scores the prompt, which needs echo
        ({"logprobs": 6}, "logprobs"),
        ({"prompt": [10**7]}, "prompt"),  # out of the vocabulary: the worker's check
        ({"prompt": ""}, "prompt"),  # empty: the worker's check
    ],
)
def test_unsupported_or_bad_options_are_400_naming_the_param(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{**GREEDY, "prompt": "x", **extra})
    assert caught.value.param == param


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask(client, tokenizer):
    """lm-evaluation-harness's completions backend: echo + logprobs, max_tokens 0 (or 1)."""
    prompt = "The capital of France is Paris"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    scored = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    legacy = choice.logprobs
    assert "".join(legacy.tokens) == prompt and len(legacy.tokens) == len(ids)
    assert legacy.token_logprobs[0] is None and legacy.top_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in legacy.token_logprobs[1:])
    assert all(len(top) >= 1 for top in legacy.top_logprobs[1:])
    assert legacy.text_offset == sorted(legacy.text_offset) and legacy.text_offset[0] == 0
    assert [prompt[o:] for o in legacy.text_offset] == [
        prompt[len("".join(legacy.tokens[:i])) :] for i in range(len(ids))
    ]
    # A likely continuation scores higher than an unlikely one, as a harness compares them.
    likely = (
        client.completions.create(
            model=MODEL, prompt="The capital of France is Paris", echo=True, logprobs=0, max_tokens=0
        )
        .choices[0]
        .logprobs.token_logprobs[-1]
    )
    unlikely = (
        client.completions.create(
            model=MODEL, prompt="The capital of France is banana", echo=True, logprobs=0, max_tokens=0
        )
        .choices[0]
        .logprobs.token_logprobs[-1]
    )
    assert likely > unlikely
    # With one generated token: the prompt's entries, then the new token's, offsets continuing.
    one = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    legacy = one.choices[0].logprobs
    assert len(legacy.tokens) == len(ids) + 1 and legacy.token_logprobs[-1] is not None
    assert one.choices[0].text.startswith(prompt) and legacy.text_offset[-1] == len(prompt)
