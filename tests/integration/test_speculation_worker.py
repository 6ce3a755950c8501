"""A real worker with --speculative ngram (the tiny model): a request that speculates gives the
tokens (and logprobs) of the same request with ``speculative: false``, which proposes nothing; and
/metrics counts the proposals per proposer."""

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
    proposed = "sluice_worker_speculative_proposed_tokens_total"
    accepted = "sluice_worker_speculative_accepted_tokens_total"
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
