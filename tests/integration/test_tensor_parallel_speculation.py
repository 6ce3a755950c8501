"""Speculative decoding at ``--tensor-parallel-size 2`` (issue 45): the session's tiny llama in
float32 at two ranks with ``--speculative ngram`` and with ``--speculative draft`` (the same tiny
model, whole on rank 0, drafting for itself) decodes the greedy tokens of one rank without
speculation, for prompts asked in one batch, and /metrics shows proposals accepted (the verifying
forwards, proposals and all, ran on both ranks)."""

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

FLOAT32 = ["--quantization", "none", "--dtype", "float32"]
PROMPTS = (
    [5, 17, 300, 41, 9, 77, 123, 88, 1000],
    [64, 2, 33, 900, 12, 450],
    [7, 7, 81, 3000, 19, 4, 250, 66],
)
TOKENS = 48
ACCEPTED = "sluice_worker_speculative_accepted_tokens_total"
PROPOSED = "sluice_worker_speculative_proposed_tokens_total"


@pytest.fixture(scope="module")
def workers(
    model_cache: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, WorkerProcess]]:
    """Two ranks speculating by lookup, two by the draft model, and one rank without speculation,
    loading side by side."""
    logs = tmp_path_factory.mktemp("tp-speculation")
    draft = ["--speculative", "draft", "--draft-model", str(tiny_model_dir), "--draft-quantization", "none"]
    draft += ["--speculative-max-rows", "4"]  # every row of the batch proposes (the draft's default: 1)
    extras = {
        "ngram": [*FLOAT32, "-tp", "2", "--speculative", "ngram", "--ngram-min", "1"],
        "draft": [*FLOAT32, "-tp", "2", *draft],
        "plain": FLOAT32,
    }
    started = {
        name: WorkerProcess(cache_dir=model_cache, log_dir=logs, model=str(tiny_model_dir), extra=extra)
        for name, extra in extras.items()
    }
    with side_by_side(list(started.values())):
        yield started


def generate(worker: WorkerProcess, prompt: list[int]) -> list[int]:
    request = pb.GenerateRequest(
        prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=prompt)),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True),
        return_token_ids=True,
    )
    with grpc.insecure_channel(worker.address) as channel:
        events = list(pb_grpc.WorkerStub(channel).Generate(request, timeout=300))
    return [token for event in events if event.HasField("content") for token in event.content.token_ids]


def together(worker: WorkerProcess) -> list[list[int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda prompt: generate(worker, prompt), PROMPTS))


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_two_speculating_ranks_decode_the_greedy_tokens_of_one_rank_without_speculation(
    workers: dict[str, WorkerProcess], proposer: str
) -> None:
    expected = together(workers["plain"])
    assert all(len(ids) == TOKENS for ids in expected)
    assert together(workers[proposer]) == expected
    metrics = workers[proposer].metrics()
    accepted, proposed = metrics[ACCEPTED], metrics[PROPOSED]
    print(f"{proposer}: {accepted:.0f} of {proposed:.0f} proposed tokens accepted")
    assert accepted > len(PROMPTS) * TOKENS // 4  # verifying forwards did most of the work
    assert "tensor-parallel rank 1 of 2 joined (gloo)" in workers[proposer].log_tail(400)


def test_two_speculating_ranks_of_a_hybrid_keep_their_states_at_the_accepted_length(
    model_cache: Path, tiny_hybrid_dir: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The session's tiny Qwen3.5 at two ranks with the tiny llama drafting for it (the same
    tokenizer; the random Qwen3.5's own texts do not repeat, so n-gram lookup would propose
    nothing) against one rank without speculation, the batch scenario of
    test_tensor_parallel_batches.py (a small pool, a shared prefix): the same greedy tokens and
    logprobs up to each text's first near-tie. The draft's proposals are nearly all rejected, and
    a rejected proposal must not advance a follower's state slots (rank 0 tells them each kept
    count), or its partial sums would part from rank 0's and the tokens with them."""
    from tests.integration.test_tensor_parallel_batches import (
        SMALL_POOL,
        assert_same_before_near_ties,
        scenario,
    )

    logs = tmp_path_factory.mktemp("tp-speculation-hybrid")
    speculating = [*SMALL_POOL, "-tp", "2", "--speculative", "draft", "--draft-model", str(tiny_model_dir)]
    speculating += ["--draft-quantization", "none", "--speculative-max-rows", "4"]
    started = [
        WorkerProcess(cache_dir=model_cache, log_dir=logs, model=str(tiny_hybrid_dir), extra=extra)
        for extra in (speculating, SMALL_POOL)
    ]
    with side_by_side(started):
        sharded, expected = scenario(started[0].address), scenario(started[1].address)
        metrics = started[0].metrics()
    assert_same_before_near_ties(sharded, expected)
    print(f"{metrics[ACCEPTED]:.0f} of {metrics[PROPOSED]:.0f} proposed tokens accepted")
    assert metrics[PROPOSED] > metrics[ACCEPTED]  # proposals verified, and rejected
