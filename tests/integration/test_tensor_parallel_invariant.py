"""``--tensor-parallel-size 3 --batch-invariant``: the default model (9 attention and 3 KV heads) on
int4 in bfloat16, three ranks on gloo. A prompt's greedy tokens, their logprobs and its prompt
logprobs asked alone equal, bit for bit, the same prompt's asked in one batch with three others: the
shards' sums add the ranks' parts in rank order (worker/parallel/ordered_sum.py). gloo's ring
all-reduce orders a row's sum by the whole tensor's size: with it this test fails (logprobs differ
in their last bits). In float32 it would pass either way: the int4 kernels' partial outputs are
bfloat16 values, whose float32 sum of three is almost always exact in any order."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import WorkerProcess

pytestmark = pytest.mark.integration

FLAGS = ["-tp", "3", "--batch-invariant", "on", "--quantization", "int4", "--dtype", "bfloat16"]
PROMPT = "Explain photosynthesis in one sentence."
OTHERS = (
    "What is the capital of France? Answer in a long paragraph about its history.",
    "Write a haiku about the sea.",
    "List three prime numbers and say why each is prime.",
)
TOKENS = 16


class Answer(NamedTuple):
    ids: list[int]
    logprobs: list[float]  # the generated tokens'
    prompt_logprobs: list[float]


def generate(address: str, text: str) -> Answer:
    """A chat prompt's greedy :data:`TOKENS` tokens, their logprobs and the prompt's logprobs."""
    request = pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=text)]),
        sampling=pb.SamplingParams(
            temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0
        ),
        return_token_ids=True,
    )
    answer = Answer([], [], [])
    with grpc.insecure_channel(address) as channel:
        for event in pb_grpc.WorkerStub(channel).Generate(request, timeout=300):
            kind = event.WhichOneof("event")
            if kind == "content":
                answer.ids.extend(event.content.token_ids)
                answer.logprobs.extend(entry.logprob for entry in event.content.logprobs)
            elif kind == "prompt_logprobs":
                answer.prompt_logprobs.extend(entry.logprob for entry in event.prompt_logprobs.logprobs)
    return answer


@pytest.fixture(scope="module")
def three_ranks(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(cache_dir=model_cache, log_dir=tmp_path_factory.mktemp("tp3-bi"), extra=FLAGS)
    try:
        worker.launch()
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


def test_a_prompt_alone_and_in_a_batch_of_others_gives_the_same_bits_on_three_ranks(
    three_ranks: WorkerProcess,
) -> None:
    alone = generate(three_ranks.address, PROMPT)
    with ThreadPoolExecutor(len(OTHERS) + 1) as pool:
        futures = [pool.submit(generate, three_ranks.address, text) for text in (*OTHERS, PROMPT)]
        crowded = [future.result() for future in futures]
    assert len(alone.ids) == len(alone.logprobs) == TOKENS and len(alone.prompt_logprobs) > 5
    assert crowded[-1].ids == alone.ids
    assert crowded[-1].logprobs == alone.logprobs  # exact: no tolerance
    assert crowded[-1].prompt_logprobs == alone.prompt_logprobs
    assert crowded[0].ids != alone.ids  # the batch did hold other work
    log = three_ranks.log_tail(400)
    assert "tensor-parallel rank 2 of 3 joined (gloo)" in log
