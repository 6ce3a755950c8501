"""A real worker with --speculative ngram (the tiny model): a request that speculates gives the
tokens (and logprobs) of the same request with ``speculative: false``, which proposes nothing;
/metrics counts the proposals per proposer; and through a real edge, the official openai SDK
streams the same text, logprobs, usage and stop with the edge's ``speculative`` extension on and
off."""

from __future__ import annotations

from typing import Any

import grpc
import openai
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def speculating_worker(model_cache, tiny_model_dir, tmp_path_factory):
    extra = ["--speculative", "ngram", "--ngram-min", "1", "--max-batch-tokens", "4000"]
    log_dir = tmp_path_factory.mktemp("speculating")
    with WorkerProcess(
        cache_dir=model_cache, log_dir=log_dir, model=str(tiny_model_dir), extra=extra
    ) as worker:
        yield worker


@pytest.fixture(scope="module")
def default_speculating(model_cache, tmp_path_factory):
    """The default model in float32 (greedy text equal with and without speculation, ties aside)
    speculating behind a real edge: the worker and the edge."""
    extra = ["--speculative", "ngram", "--quantization", "none"]
    log_dir = tmp_path_factory.mktemp("speculating-default")
    with (
        WorkerProcess(cache_dir=model_cache, log_dir=log_dir, extra=extra) as worker,
        EdgeProcess([worker.address], log_dir=log_dir) as edge,
    ):
        yield worker, edge


PROPOSED = "sluice_worker_speculative_proposed_tokens_total"
ACCEPTED = "sluice_worker_speculative_accepted_tokens_total"


def generate(stub: pb_grpc.WorkerStub, **sampling) -> tuple[list[int], list[float]]:
    """The token ids and their logprobs (when asked) of one greedy request."""
    request = pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Repeat exactly: one two three")]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, **sampling),
        return_token_ids=True,
    )
    ids: list[int] = []
    logprobs: list[float] = []
    for event in stub.Generate(request):
        if event.WhichOneof("event") == "content":
            ids += list(event.content.token_ids)
            logprobs += [entry.logprob for entry in event.content.logprobs]
    return ids, logprobs


def test_speculating_requests_equal_unspeculated_ones_and_acceptance_is_counted(speculating_worker):
    proposed, accepted = PROPOSED, ACCEPTED
    with grpc.insecure_channel(speculating_worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        before = speculating_worker.metrics()
        plain, _ = generate(stub, speculative=False)
        plain_logprobs = generate(stub, speculative=False, logprobs=2, repetition_penalty=1.2)
        off = speculating_worker.metrics()
        fast, _ = generate(stub)
        fast_logprobs = generate(stub, speculative=True, logprobs=2, repetition_penalty=1.2)
    after = speculating_worker.metrics()
    assert off[proposed] == before[proposed]  # speculative: false proposes nothing
    assert len(plain) == 40 and fast == plain
    assert fast_logprobs[0] == plain_logprobs[0] and len(fast_logprobs[1]) == 40
    assert fast_logprobs[1] == pytest.approx(plain_logprobs[1], abs=1e-4)
    assert after[accepted] > off[accepted]  # the tiny model repeats itself: lookups hit
    assert after[proposed] >= after[accepted]


COPY = (
    "Repeat the following text exactly, word for word: The river ran quietly past the old mill, "
    "where a small cafe served coffee to travellers on their way north."
)


def sdk_stream(client: openai.OpenAI, speculative: bool, **options: Any) -> tuple[str, list[Any], int, str]:
    """One streamed greedy chat completion copying a sentence: its text, (token, logprob) pairs,
    completion tokens and finish reason as the SDK hands them over."""
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": COPY}],
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=2,
        extra_body={"speculative": speculative, "ignore_eos": True},
        **options,
    )
    text, logprobs, completion_tokens, finish = "", [], 0, ""
    for chunk in stream:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs += [(entry.token, entry.logprob) for entry in choice.logprobs.content]
            finish = choice.finish_reason or finish
    return text, logprobs, completion_tokens, finish


def test_the_openai_sdk_streams_the_same_completion_with_and_without_speculation(default_speculating):
    worker, edge = default_speculating
    client = openai.OpenAI(base_url=f"{edge.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    before = worker.metrics()
    plain = sdk_stream(client, False)
    fast = sdk_stream(client, True)
    assert worker.metrics()[ACCEPTED] > before[ACCEPTED]  # several tokens per step
    assert (fast[0], fast[2], fast[3]) == (plain[0], 40, "length")
    assert [token for token, _ in fast[1]] == [token for token, _ in plain[1]] and len(plain[1]) == 40
    assert [lp for _, lp in fast[1]] == pytest.approx([lp for _, lp in plain[1]], abs=1e-3)
    # A word from the middle of the text, as a stop string, cuts both at the same place.
    words = plain[0].split()
    stop = words[len(words) // 2]
    cut_plain, cut_fast = sdk_stream(client, False, stop=[stop]), sdk_stream(client, True, stop=[stop])
    assert cut_fast[3] == cut_plain[3] == "stop"
    assert cut_fast[0] == cut_plain[0] and len(cut_plain[0]) < len(plain[0])
