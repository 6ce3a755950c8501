"""Pre-quantized checkpoints under ``--tensor-parallel-size 2`` (tools/quant_fixtures.py's GPTQ, GPTQ
act-order and FP8-dynamic checkpoints of a tiny Llama, 4 heads and 2 KV heads, made by the real
tools): a real
worker of two ranks on gloo, each rank holding its slice of the quantized layers as read
(worker/parallel/quantized_shards.py), against one rank of the same checkpoint: greedy tokens
identical and prompt logprobs within the measured tolerance, for two prompts asked together."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sluice.v1 import worker_pb2 as pb
from tests.grpc_reads import ids_and_prompt_logprobs
from tests.processes import WorkerProcess, side_by_side
from tests.quant_checkpoints import quant_checkpoint
from tools.quant_fixtures import PROMPT

pytestmark = pytest.mark.integration

PROMPTS = [PROMPT, [(7 * i + 3) % 126 + 2 for i in range(40)]]
TOKENS = 24
# The most a prompt logprob of two ranks may move from one rank's. GPTQ's int4 CPU products round
# their results to bfloat16 (a row-parallel shard's two halves are rounded apart, then summed):
# measured up to 7.7e-4 here (act-order, whose row-parallel shards hold half the groups each and
# read the gathered input: 8.9e-4). FP8-dynamic's shards round the same inputs as one rank (each row under
# the whole row's scale) and upcast in float32: only the summation order differs (measured 4.8e-7).
TOLERANCE = {"gptq": 3e-3, "gptq_act_order": 3e-3, "fp8_dynamic": 1e-5}


@pytest.fixture(scope="module", params=list(TOLERANCE))
def workers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, WorkerProcess, WorkerProcess]]:
    """Two ranks and one rank of the format's checkpoint, loading side by side."""
    name = request.param
    folder = quant_checkpoint(name)
    logs = tmp_path_factory.mktemp(f"tp-prequantized-{name}")
    started = [
        WorkerProcess(cache_dir=logs, log_dir=logs, model=str(folder), extra=["--device", "cpu", *extra])
        for extra in (["-tp", "2"], [])
    ]
    with side_by_side(started):
        yield name, started[0], started[1]


def asked(worker: WorkerProcess) -> list[tuple[list[int], list[float]]]:
    """Each of :data:`PROMPTS`' greedy ids and prompt logprobs, the prompts asked together."""

    def one(prompt: list[int]) -> tuple[list[int], list[float]]:
        request = pb.GenerateRequest(
            prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=prompt)),
            sampling=pb.SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, prompt_logprobs=0),
            return_token_ids=True,
        )
        return ids_and_prompt_logprobs(worker.address, request)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def test_two_ranks_of_a_prequantized_checkpoint_generate_one_ranks_tokens(
    workers: tuple[str, WorkerProcess, WorkerProcess],
) -> None:
    name, two, one = workers
    for (ids, scored), (want_ids, want_scored) in zip(asked(two), asked(one), strict=True):
        assert len(ids) == TOKENS and ids == want_ids
        assert len(scored) == len(want_scored) > 10
        moved = max(abs(a - b) for a, b in zip(scored, want_scored, strict=True))
        print(f"{name}: prompt logprobs of two ranks within {moved:.1e} of one rank's")
        assert moved <= TOLERANCE[name]
    log = two.log_tail(400)
    assert "tensor-parallel rank 1 of 2 joined (gloo)" in log and "quantized checkpoint: " in log
