"""The prefix cache's host tier (``--kv-offload-bytes``) on a real worker (the default model): a device
pool of 64 blocks and a 1 GiB host tier serve 8 conversations of 3 turns, round robin, each with its
own ~250-token system prompt (together far more than the pool); the later turns find their earlier
tokens cached (copied back from the host) and answer as the session's large-pool worker does."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import WorkerProcess

pytestmark = pytest.mark.integration

# 64 blocks of 16 tokens (the default block size) and a 1 GiB host tier.
TIERED = ["--max-batch-tokens", "1024", "--kv-offload-bytes", str(1 << 30)]
CONVERSATIONS, TURNS = 8, 3
WORDS = (
    "harbour",
    "lantern",
    "meadow",
    "copper",
    "orchard",
    "violin",
    "granite",
    "pepper",
    "saddle",
    "thunder",
    "marble",
    "willow",
)
# Each turn makes the model copy from its system prompt, so an answer depends on the cached KV.
FOLLOW_UPS = (
    "Repeat the first ten words of your instructions.",
    "Now repeat the last ten words.",
    "Repeat the first ten words again.",
)


@pytest.fixture(scope="module")
def tiered(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    logs = tmp_path_factory.mktemp("kv-host-tier")
    with WorkerProcess(cache_dir=model_cache, log_dir=logs, extra=TIERED) as worker:
        yield worker


def system_prompt(index: int) -> str:
    """About 250 tokens, its own from the first words on (no prefix shared between conversations)."""
    rng = random.Random(index)
    return f"Assistant number {index}. " + " ".join(rng.choice(WORDS) for _ in range(190))


def round_robin(address: str) -> tuple[list[list[str]], list[list[tuple[int, int]]]]:
    """Each conversation's answers and, per turn, ``(prompt_tokens, cached_tokens)``, the turns
    taken round robin over the conversations, one request at a time (greedy, 12 tokens)."""
    messages = [[pb.ChatMessage(role="system", content=system_prompt(i))] for i in range(CONVERSATIONS)]
    answers: list[list[str]] = [[] for _ in range(CONVERSATIONS)]
    usage: list[list[tuple[int, int]]] = [[] for _ in range(CONVERSATIONS)]
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        for turn in range(TURNS):
            for index in range(CONVERSATIONS):
                messages[index].append(pb.ChatMessage(role="user", content=FOLLOW_UPS[turn]))
                request = pb.GenerateRequest(
                    chat=pb.ChatInput(messages=messages[index]),
                    sampling=pb.SamplingParams(temperature=0, max_tokens=12),
                )
                events = list(stub.Generate(request))
                text = "".join(e.content.text for e in events if e.HasField("content"))
                messages[index].append(pb.ChatMessage(role="assistant", content=text))
                answers[index].append(text)
                usage[index].append((events[-1].usage.prompt_tokens, events[-1].usage.cached_tokens))
    return answers, usage


def test_later_turns_come_back_from_the_host_tier_with_the_large_pools_answers(
    tiered: WorkerProcess, default_worker: WorkerProcess
) -> None:
    before = tiered.metrics()
    answers, usage = round_robin(tiered.address)
    earlier = cached = 0
    for turns in usage:
        for (previous_prompt, _), (_, hit) in itertools.pairwise(turns):
            earlier += previous_prompt
            cached += min(hit, previous_prompt)
    print(f"host tier: {cached} of {earlier} earlier-turn tokens cached ({cached / earlier:.1%})")
    assert cached >= 0.9 * earlier, usage
    after = tiered.metrics()
    assert after["sluice_worker_kv_host_hits_total"] > before.get("sluice_worker_kv_host_hits_total", 0)
    assert after["sluice_worker_kv_host_bytes_to_host_total"] > 0
    assert after["sluice_worker_kv_host_bytes_to_device_total"] > 0
    assert 0 < after["sluice_worker_kv_host_blocks_used"] <= after["sluice_worker_kv_host_blocks"]
    reference, _ = round_robin(default_worker.address)
    assert answers == reference
