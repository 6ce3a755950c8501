"""Scale-out with two real workers behind a real edge with prefix-affinity routing. The workers run
no model (``--fake-tokens``): the routing, the prefix cache and the metrics do not depend on it.

- Multi-turn conversations stay on the worker that served their first turn,
  and the worker's own ``cached_tokens`` shows the later turns served mostly
  from its prefix cache (the full 20 x 4 figure, for both policies, is
  the retired ``bench/bench_routing.py``, docs/operations.md).
- Every worker started with ``--metrics-names both`` shows the endpoint
  picker's gauges under vLLM's names beside Sluice's own.
- A storm of invalid requests that the workers themselves reject
  (NOT_FOUND, INVALID_ARGUMENT) ejects no worker: both keep serving.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conversations import cached_fraction, run_conversations
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

WORKER_FLAGS = ["--fake-tokens", "--metrics-names", "both"]
PICKER_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def workers(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    logs = tmp_path_factory.mktemp("routing-workers")
    started = []
    for worker_id in ("A", "B"):
        (logs / worker_id).mkdir()
        extra = [*WORKER_FLAGS, "--worker-id", worker_id]
        started.append(WorkerProcess(cache_dir=model_cache, log_dir=logs / worker_id, extra=extra))
    a, b = started
    with a, b:
        yield started


@pytest.fixture(scope="module")
def edge(workers: list[WorkerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProcess]:
    flags = ["--routing", "prefix-affinity", "--health-interval", "0.5"]
    addresses = [w.address for w in workers]
    with EdgeProcess(addresses, log_dir=tmp_path_factory.mktemp("routing-edge"), extra=flags) as process:
        yield process


def test_later_turns_stay_on_their_worker_and_are_served_from_its_cache(edge: EdgeProcess) -> None:
    turns = asyncio.run(run_conversations(edge.base_url, conversations=6, turns=3, parallel=3))
    first_worker = {t.conversation: t.worker_id for t in turns if t.turn == 0}
    assert set(first_worker.values()) == {"A", "B"}, "new conversations are spread by load"
    later = [t for t in turns if t.turn > 0]
    assert all(t.worker_id == first_worker[t.conversation] for t in later), later
    fraction = cached_fraction(turns)
    print(f"prefix-affinity: {fraction:.0%} of {len(later)} later turns had >= half their prompt cached")
    assert fraction >= 0.9, later


def _families(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(text)
    }


def test_every_worker_shows_the_endpoint_pickers_gauges(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        families = _families(worker.metrics_port)
        for name in PICKER_GAUGES:
            [(labels, value)] = families[name]
            assert set(labels) == {"model_name"} and labels["model_name"], labels
            assert value >= 0
            print(f"worker {worker.address}: {name}{labels} {value}")
        [(_labels, usage)] = families["vllm:kv_cache_usage_perc"]
        assert 0.0 <= usage <= 1.0
        [(info, one)] = families["vllm:cache_config_info"]
        assert one == 1 and set(info) == {"block_size", "num_gpu_blocks"}
        assert int(info["block_size"]) >= 1 and int(info["num_gpu_blocks"]) >= 1
        print(f"worker {worker.address}: vllm:cache_config_info{info} 1.0")
        # Sluice's own names are still there, with the same values.
        [(_labels, waiting)] = families["sluice_worker_queue_depth"]
        assert waiting == families["vllm:num_requests_waiting"][0][1]


def test_a_storm_of_invalid_requests_ejects_no_worker(edge: EdgeProcess) -> None:
    question = [{"role": "user", "content": "hi"}]
    invalid = [
        ({"model": "no-such-model", "messages": question}, 404),  # the worker answers NOT_FOUND
        # The edge cannot know the vocabulary: the worker answers INVALID_ARGUMENT.
        ({"messages": question, "logit_bias": {"999999999": 5}}, 400),
    ]

    async def storm() -> list[int]:
        async with httpx.AsyncClient(base_url=edge.base_url, timeout=60) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            requests = [({"model": model, **body}, status) for body, status in invalid * 20]
            responses = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for body, _status in requests)
            )
            for (_body, status), response in zip(requests, responses, strict=True):
                assert response.status_code == status, response.text
            return [r.status_code for r in responses]

    statuses = asyncio.run(storm())
    assert len(statuses) == 40
    with urllib.request.urlopen(f"{edge.base_url}/ready", timeout=5) as response:
        ready = json.loads(response.read())
    assert [w["status"] for w in ready["workers"]] == ["SERVING", "SERVING"], ready
