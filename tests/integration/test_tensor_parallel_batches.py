"""Issue 45's batches with preemption and prefix hits: the session's tiny llama in float32 served by
one ``--tensor-parallel-size 2`` worker with a pool too small for its batch (streams preempted and
recomputed) and a long prompt prefix seen before (its blocks reused) decodes the greedy tokens of
a one-rank worker given the same requests, their logprobs within 1e-4 (a random model's attention
barely moves its greedy tokens; the logprobs show a wrong KV block), and reports the prefix's
tokens as cached."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import WorkerProcess, side_by_side

pytestmark = pytest.mark.integration

# 16 blocks of 16 tokens, prompts computed 64 tokens a step: eight streams of a shared 96-token
# prefix (6 blocks), 8 tokens of their own and 24 generated (2 blocks each) need 22, so some are
# preempted and recomputed, their prefix found again.
SMALL_POOL = ["--quantization", "none", "--dtype", "float32"]
SMALL_POOL += ["--max-batch-tokens", "256", "--max-prefill-tokens", "64"]
PREFIX = [(37 * i + 11) % 5000 + 100 for i in range(96)]
STREAMS = 8
TOKENS = 24


# A random model's logits are nearly flat: where its two best tokens are closer than this, the
# ranks' other summation order may pick either, and the texts part there.
NEAR_TIE = 1e-3


class Answer:
    """A request's generated token ids, their logprobs, each position's margin between its two best
    tokens, and its usage's ``cached_tokens``."""

    def __init__(self, ids: list[int], logprobs: list[float], margins: list[float], cached: int):
        self.ids, self.logprobs, self.margins, self.cached = ids, logprobs, margins, cached

    def before_a_near_tie(self) -> int:
        """How many leading tokens are chosen by a margin of at least :data:`NEAR_TIE`."""
        return next((i for i, margin in enumerate(self.margins) if margin < NEAR_TIE), len(self.margins))


def prompt(index: int) -> list[int]:
    return [*PREFIX, *[(index * 53 + j * 7) % 3000 + 200 for j in range(8)]]


def generate(address: str, ids: list[int]) -> Answer:
    request = pb.GenerateRequest(
        prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=2),
        return_token_ids=True,
    )
    generated: list[int] = []
    logprobs: list[float] = []
    margins: list[float] = []
    cached = -1
    with grpc.insecure_channel(address) as channel:
        for event in pb_grpc.WorkerStub(channel).Generate(request, timeout=300):
            if event.HasField("content"):
                generated += list(event.content.token_ids)
                logprobs += [entry.logprob for entry in event.content.logprobs]
                margins += [
                    top[0].logprob - top[1].logprob
                    for top in (e.top_logprobs for e in event.content.logprobs)
                ]
            if event.HasField("usage"):
                cached = event.usage.cached_tokens
    return Answer(generated, logprobs, margins, cached)


def scenario(address: str) -> list[Answer]:
    """One request with the prefix (its blocks then cached), then :data:`STREAMS` of them at once."""
    first = generate(address, prompt(STREAMS))
    with ThreadPoolExecutor(STREAMS) as pool:
        return [first, *pool.map(lambda index: generate(address, prompt(index)), range(STREAMS))]


def assert_same_before_near_ties(sharded: list[Answer], expected: list[Answer]) -> None:
    """Every answer of ``sharded`` has ``expected``'s tokens, and their logprobs within 1e-4, up to
    the expected text's first near-tie (past one the texts may part; up to it they may not), and at
    least half of all the tokens are compared."""
    compared = 0
    for got, want in zip(sharded, expected, strict=True):
        assert len(got.ids) == len(got.logprobs) == TOKENS
        same = want.before_a_near_tie()
        assert got.ids[:same] == want.ids[:same]
        assert got.logprobs[:same] == pytest.approx(want.logprobs[:same], abs=1e-4)
        compared += same
    print(f"{compared} of {len(expected) * TOKENS} tokens compared (before each text's first near-tie)")
    assert compared >= len(expected) * TOKENS // 2


@pytest.fixture(scope="module")
def workers(
    model_cache: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """Two ranks and one rank of the tiny llama with the same small pool, loading side by side."""
    logs = tmp_path_factory.mktemp("tp-batches")
    started = [
        WorkerProcess(cache_dir=model_cache, log_dir=logs, model=str(tiny_model_dir), extra=extra)
        for extra in ([*SMALL_POOL, "-tp", "2"], SMALL_POOL)
    ]
    with side_by_side(started):
        yield started[0], started[1]


def test_two_ranks_preempted_and_reusing_a_prefix_decode_the_tokens_of_one(
    workers: tuple[WorkerProcess, WorkerProcess],
) -> None:
    two, one = workers
    assert_sharded_scenario(two, one)
    assert "tensor-parallel rank 1 of 2 joined (gloo)" in two.log_tail(400)


def assert_sharded_scenario(two: WorkerProcess, one: WorkerProcess) -> None:
    """:func:`scenario` on both workers: the same answers up to near-ties, the prefix reported
    cached after its first request, and the two ranks' small pool preempting."""
    sharded, expected = scenario(two.address), scenario(one.address)
    assert_same_before_near_ties(sharded, expected)
    assert sharded[0].cached == 0 and all(answer.cached >= len(PREFIX) for answer in sharded[1:])
    preempted = two.metrics()["sluice_worker_preemptions_total"]
    print(f"two ranks: {preempted:.0f} preemptions")
    assert preempted > 0  # the pool did run short
