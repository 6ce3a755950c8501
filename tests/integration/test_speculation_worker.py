"""A real worker with --speculative ngram (the tiny model): a greedy request that speculates gives
the tokens of the same request made ineligible (logprobs asked: it decodes plainly), and /metrics
counts the proposals it accepted."""

from __future__ import annotations

import grpc
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import WorkerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def speculating_worker(model_cache, tiny_model_dir, tmp_path_factory):
    extra = ["--speculative", "ngram", "--ngram-min", "1", "--max-batch-tokens", "4000"]
    log_dir = tmp_path_factory.mktemp("speculating")
    with WorkerProcess(
        cache_dir=model_cache, log_dir=log_dir, model=str(tiny_model_dir), extra=extra
    ) as worker:
        yield worker


def tokens(stub: pb_grpc.WorkerStub, **sampling) -> list[int]:
    request = pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Repeat exactly: one two three")]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, **sampling),
        return_token_ids=True,
    )
    ids = []
    for event in stub.Generate(request):
        if event.WhichOneof("event") == "content":
            ids += list(event.content.token_ids)
    return ids


def test_speculating_greedy_tokens_equal_plain_ones_and_acceptance_is_counted(speculating_worker):
    with grpc.insecure_channel(speculating_worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        plain = tokens(stub, logprobs=0)  # not eligible: decoded one token a step
        before = speculating_worker.metrics()
        fast = tokens(stub)
    after = speculating_worker.metrics()
    assert len(plain) == 40 and fast == plain
    accepted = "sluice_worker_speculative_accepted_tokens_total"
    proposed = "sluice_worker_speculative_proposed_tokens_total"
    assert after[accepted] > before[accepted]  # the tiny model repeats itself: lookups hit
    assert after[proposed] >= after[accepted]
