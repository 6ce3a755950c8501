"""``--tensor-parallel-size 3`` against one rank, for the default model in float32 (9 attention and
3 KV heads): greedy tokens identical, prompt logprobs within 1e-4, and concurrent streams through
an edge end with the texts one rank generates one at a time. One three-rank worker for the module,
asked everything in one batch (its steps, each 60 all-reduces among three processes on a shared
machine, are what the module's time goes to); the one-rank reference is the session's
``float_worker``, asked once per prompt."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import grpc
import httpx
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import EdgeProcess, WorkerProcess
from worker.model.loader import DEFAULT_MODEL_ID

pytestmark = pytest.mark.integration

FLOAT32 = ["--quantization", "none", "--dtype", "float32"]
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
)
TOKENS = 32


@pytest.fixture(scope="module")
def workers(
    model_cache: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """One rank (the session's ``float_worker``) and three ranks of the default model in float32,
    loading side by side."""
    three = WorkerProcess(
        cache_dir=model_cache, log_dir=tmp_path_factory.mktemp("tp3-logs"), extra=[*FLOAT32, "-tp", "3"]
    )
    try:
        three.launch()
        one = request.getfixturevalue("float_worker")
        three.wait_ready()
        yield one, three
    finally:
        three.stop()


@pytest.fixture(scope="module")
def edge(
    workers: tuple[WorkerProcess, WorkerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EdgeProcess]:
    with EdgeProcess([workers[1].address], log_dir=tmp_path_factory.mktemp("tp-edge")) as started:
        yield started


class Generated(NamedTuple):
    ids: list[int]
    logprobs: list[float]  # the prompt's
    text: str


def generate(worker: WorkerProcess, text: str) -> Generated:
    """A chat prompt's greedy :data:`TOKENS` tokens (ids and text) and its prompt logprobs."""
    request = pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=text)]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, prompt_logprobs=0),
        return_token_ids=True,
    )
    generated = Generated([], [], "")
    with grpc.insecure_channel(worker.address) as channel:
        for event in pb_grpc.WorkerStub(channel).Generate(request, timeout=300):
            kind = event.WhichOneof("event")
            if kind == "content":
                generated.ids.extend(event.content.token_ids)
                generated = generated._replace(text=generated.text + event.content.text)
            elif kind == "prompt_logprobs":
                generated.logprobs.extend(entry.logprob for entry in event.prompt_logprobs.logprobs)
    return generated


@pytest.fixture(scope="module")
def one_rank(workers: tuple[WorkerProcess, WorkerProcess]) -> dict[str, Generated]:
    """What one rank generates for each of :data:`PROMPTS`, asked one at a time."""
    return {text: generate(workers[0], text) for text in PROMPTS}


# Eight streams through the edge, each prompt twice.
STREAMED = [PROMPTS[i % len(PROMPTS)] for i in range(8)]


async def stream(client: httpx.AsyncClient, edge: EdgeProcess, text: str) -> str:
    """A chat prompt's greedy :data:`TOKENS` tokens streamed through ``edge``: the deltas' text."""
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    parts = []
    async with client.stream("POST", f"{edge.base_url}/v1/chat/completions", json=body) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                parts += [choice["delta"].get("content") or "" for choice in chunk["choices"]]
    return "".join(parts)


class ThreeRanks(NamedTuple):
    """The three ranks' answers: :data:`PROMPTS` over gRPC, :data:`STREAMED` through the edge."""

    asked: dict[str, Generated]
    streamed: list[str]


@pytest.fixture(scope="module")
def three_ranks(workers: tuple[WorkerProcess, WorkerProcess], edge: EdgeProcess) -> ThreeRanks:
    """Both tests' requests sent to the three ranks at once: the four gRPC requests and the eight
    streams run as one batch of twelve (33 steps instead of two runs' 66; a batch of twelve
    proves no less than a batch of four or eight)."""
    three = workers[1]

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client:
            return list(await asyncio.gather(*(stream(client, edge, text) for text in STREAMED)))

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        asked = [pool.submit(generate, three, text) for text in PROMPTS]
        streamed = asyncio.run(together())
        return ThreeRanks(
            {text: future.result() for text, future in zip(PROMPTS, asked, strict=True)}, streamed
        )


def test_three_ranks_generate_the_greedy_tokens_and_prompt_logprobs_of_one(
    workers: tuple[WorkerProcess, WorkerProcess], three_ranks: ThreeRanks, one_rank: dict[str, Generated]
) -> None:
    """The four prompts asked of the three ranks together (in one batch with the edge's streams),
    against one rank's answers asked one at a time."""
    for text in PROMPTS:
        generated, expected = three_ranks.asked[text], one_rank[text]
        assert len(generated.ids) == TOKENS and generated.ids == expected.ids, text
        assert len(generated.logprobs) == len(expected.logprobs) > 5
        assert generated.logprobs == pytest.approx(expected.logprobs, abs=1e-4), text
    log = workers[1].log_tail(400)
    assert (
        "tensor-parallel rank 2 started (pid " in log and "tensor-parallel rank 2 of 3 joined (gloo)" in log
    )


def test_eight_concurrent_streams_through_an_edge_end_with_the_sequential_texts(
    three_ranks: ThreeRanks, one_rank: dict[str, Generated]
) -> None:
    assert three_ranks.streamed == [one_rank[text].text for text in STREAMED]
