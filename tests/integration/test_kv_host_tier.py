"""The prefix cache's host tier (``--kv-offload-bytes``) on a real worker (the default model, its
engine in a process of its own, where the tier lives): a device pool of 64 blocks and a 1 GiB host
tier serve 8 conversations of 3 turns, round robin, each with its own ~250-token system prompt
(together about twice the pool); the later turns find their earlier tokens cached (copied back
from the host) and answer as the session's large-pool (in-process) worker does."""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import WorkerProcess

pytestmark = pytest.mark.integration

# 64 blocks of 16 tokens (the default block size) and a 1 GiB host tier. The engine process builds
# the tier as an in-process engine does (the same start-up), and its metrics cross the pipe.
TIERED = ["--max-batch-tokens", "1024", "--kv-offload-bytes", str(1 << 30), "--engine-process"]
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
# Enough for an answer to show the copied words; the bar's cost is mostly its decode steps.
ANSWER_TOKENS = 4
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


@dataclass
class Run:
    """One worker's copy of the conversations: their messages, answers and, per turn,
    ``(prompt_tokens, cached_tokens)``."""

    stub: pb_grpc.WorkerStub
    messages: list[list[pb.ChatMessage]]
    answers: list[list[str]] = field(default_factory=lambda: [[] for _ in range(CONVERSATIONS)])
    usage: list[list[tuple[int, int]]] = field(default_factory=lambda: [[] for _ in range(CONVERSATIONS)])

    def turn(self, index: int, question: str) -> None:
        """Conversation ``index`` asks ``question`` and gets a greedy answer of ANSWER_TOKENS tokens."""
        self.messages[index].append(pb.ChatMessage(role="user", content=question))
        request = pb.GenerateRequest(
            chat=pb.ChatInput(messages=self.messages[index]),
            sampling=pb.SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS),
        )
        events = list(self.stub.Generate(request))
        text = "".join(e.content.text for e in events if e.HasField("content"))
        self.messages[index].append(pb.ChatMessage(role="assistant", content=text))
        self.answers[index].append(text)
        self.usage[index].append((events[-1].usage.prompt_tokens, events[-1].usage.cached_tokens))


def round_robin(addresses: list[str]) -> list[Run]:
    """Each worker's run of the conversations, the turns taken round robin over the conversations,
    one request at a time on each worker (the workers answer the same turn at once)."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(addresses)) as pool:
        runs = [
            Run(
                pb_grpc.WorkerStub(stack.enter_context(grpc.insecure_channel(address))),
                [[pb.ChatMessage(role="system", content=system_prompt(i))] for i in range(CONVERSATIONS)],
            )
            for address in addresses
        ]
        for turn in range(TURNS):
            for index in range(CONVERSATIONS):
                list(pool.map(lambda run, i=index, t=turn: run.turn(i, FOLLOW_UPS[t]), runs))
    return runs


def test_later_turns_come_back_from_the_host_tier_with_the_large_pools_answers(
    tiered: WorkerProcess, default_worker: WorkerProcess
) -> None:
    before = tiered.metrics()
    run, reference = round_robin([tiered.address, default_worker.address])
    earlier = cached = 0
    for turns in run.usage:
        for (previous_prompt, _), (_, hit) in itertools.pairwise(turns):
            earlier += previous_prompt
            cached += min(hit, previous_prompt)
    print(f"host tier: {cached} of {earlier} earlier-turn tokens cached ({cached / earlier:.1%})")
    assert cached >= 0.9 * earlier, run.usage
    after = tiered.metrics()
    assert after["sluice_worker_kv_host_hits_total"] > before.get("sluice_worker_kv_host_hits_total", 0)
    assert after["sluice_worker_kv_host_bytes_to_host_total"] > 0
    assert after["sluice_worker_kv_host_bytes_to_device_total"] > 0
    assert 0 < after["sluice_worker_kv_host_blocks_used"] <= after["sluice_worker_kv_host_blocks"]
    assert run.answers == reference.answers
