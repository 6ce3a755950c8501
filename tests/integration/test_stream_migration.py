"""A worker SIGKILLed under streams: every stream moves to the other worker and reads as undisturbed.

Real processes on 127.0.0.1: two workers serving the default model with
``--batch-invariant`` (so a sequence's numbers do not depend on what shares its
steps, nor on whether its tokens were decoded or recomputed as a prompt on the
other worker), one edge (stream migration on, its default). Six greedy streams
run once undisturbed, then all on worker A, which is killed mid-stream
(``tests/migration_scenario.py``). Every client (the official ``openai`` SDK)
must get a complete stream (finish reason, usage, no error event) whose text
equals the undisturbed run's, token for token. The
streams are short here to keep the test quick on two cores;
The retired ``bench/bench_migration.py`` ran the full bar (6 streams of 400 tokens; figures in
docs/operations.md, "A stream survives its worker's death").
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.migration_scenario import EDGE_FLAGS, kill_under_streams
from tests.processes import EdgeProcess, WorkerProcess, side_by_side

pytestmark = pytest.mark.integration

STREAMS = 6
MAX_TOKENS = 40  # with ignore_eos: past the model's own end, where near-ties are many
KILL_AFTER_CHUNKS = 12  # the move carries a dozen tokens or more of every stream


@pytest.fixture(scope="module")
def two_workers(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    logs = tmp_path_factory.mktemp("migration-workers")
    workers = []
    for worker_id in ("A", "B"):
        (logs / worker_id).mkdir()
        extra = [
            "--worker-id",
            worker_id,
            "--max-running",
            "8",
            "--batch-invariant",
            "on",
        ]
        workers.append(WorkerProcess(cache_dir=model_cache, log_dir=logs / worker_id, extra=extra))
    with side_by_side(workers):
        yield workers


def test_streams_survive_their_worker_being_killed(two_workers, tmp_path: Path) -> None:
    a, b = two_workers
    with EdgeProcess([a.address, b.address], log_dir=tmp_path, extra=EDGE_FLAGS) as edge:
        result = asyncio.run(
            kill_under_streams(
                edge, a, b, STREAMS, MAX_TOKENS, ignore_eos=True, kill_after_chunks=KILL_AFTER_CHUNKS
            )
        )
    for before, after in zip(result.undisturbed, result.disturbed, strict=True):
        assert after.finish_reason in ("stop", "length") and after.completion_tokens is not None
        assert after.text == before.text
        assert after.completion_tokens == before.completion_tokens
    counts = result.migrations
    # Every stream still running at the kill moved once; none failed to.
    running_at_kill = sum(
        1 for r in result.disturbed if r.ended_at is not None and r.ended_at > result.killed_at
    )
    assert counts["resumed"] == running_at_kill >= 1
    assert counts["failed"] == counts["limit_reached"] == counts["not_resumable"] == 0
