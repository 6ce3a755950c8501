"""``--api-server-count``: several serving processes on one port, fed by one engine process. The
kernel spreads connections over them, each serves its callers' streams whole, an edge with
``--worker-connections`` reaches every one; a serving process that dies ends the worker (status 3);
SIGTERM drains every one of them."""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.integration.test_engine_process import alive, engine_pid
from tests.integration.test_worker_grpc import chat
from tests.processes import EdgeProcess, WorkerProcess, free_port
from worker.config import WorkerConfig
from worker.server import serving_of_engine
from worker.serving_processes import ServingProcessError, ServingProcesses

pytestmark = pytest.mark.integration

FAKE = ["--fake-tokens", "--fake-step-ms", "5", "--api-server-count", "2"]


def more_serving_pids(worker: WorkerProcess) -> list[int]:
    """The pids of the serving processes beyond the first, from the worker's start-up line."""
    found = re.search(r"more serving processes on the port \(pids \[([\d, ]+)\]\)", worker.log_tail(400))
    assert found, worker.log_tail()
    return [int(pid) for pid in found.group(1).split(",")]


def first_serving_pid(worker: WorkerProcess) -> int:
    assert worker.proc is not None
    return worker.proc.pid


def accepted(pid: int, port: int) -> int:
    """How many established TCP connections on local ``port`` process ``pid`` holds (its accepted
    callers), from /proc: its socket descriptors' inodes against the kernel's TCP tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if fields[3] == "01" and local_port == port and fields[9] in inodes:
                    count += 1
    return count


def own_channel(address: str) -> grpc.Channel:
    """A channel with a connection of its own (gRPC shares one per target within a process)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def text_and_usage(stub: pb_grpc.WorkerStub, max_tokens: int) -> tuple[str, int, str]:
    events = list(stub.Generate(chat("Tell me a story.", max_tokens=max_tokens, temperature=0.0), timeout=60))
    text = "".join(e.content.text for e in events if e.HasField("content"))
    finished = [e.finished.reason for e in events if e.HasField("finished")]
    usage = [e.usage.completion_tokens for e in events if e.HasField("usage")]
    assert len(finished) == 1 and len(usage) == 1, events
    return text, usage[0], finished[0]


@pytest.fixture
def worker(model_cache: Path, tmp_path: Path) -> Iterator[WorkerProcess]:
    with WorkerProcess(cache_dir=model_cache, log_dir=tmp_path, extra=FAKE) as started:
        yield started


def connections_on_each(worker: WorkerProcess, pids: list[int]) -> tuple[list[grpc.Channel], list[int]]:
    """Opens connections (one call each, so the connection is accepted) until every serving process
    holds one; returns the channels and the serving process of each."""
    channels: list[grpc.Channel] = []
    owners: list[int] = []
    for _ in range(64):  # two processes: all 64 on one of them would be 2 ** -63
        channel = own_channel(worker.address)
        before = {pid: accepted(pid, worker.port) for pid in pids}
        pb_grpc.WorkerStub(channel).Tokenize(
            pb.TokenizeRequest(prompt=pb.PromptInput(text="hello")), timeout=10
        )
        after = {pid: accepted(pid, worker.port) for pid in pids}
        grew = [pid for pid in pids if after[pid] > before[pid]]
        assert len(grew) == 1, (before, after)
        channels.append(channel)
        owners.append(grew[0])
        if set(owners) == set(pids):
            return channels, owners
    raise AssertionError(f"64 connections, all on {set(owners)}")


def test_connections_spread_over_the_serving_processes_and_each_serves_whole_streams(
    worker: WorkerProcess,
) -> None:
    """Every serving process accepts connections on the one port, and the streams it serves are
    the engine's whole: concurrent requests of different lengths, each over a connection of either
    process, give the same text and usage as one request at a time over the first connection."""
    pids = [first_serving_pid(worker), *more_serving_pids(worker)]
    assert engine_pid(worker) not in pids and all(alive(pid) for pid in pids)
    channels, owners = connections_on_each(worker, pids)
    try:
        lengths = [8 + 7 * i for i in range(8)]
        reference = {n: text_and_usage(pb_grpc.WorkerStub(channels[0]), n) for n in lengths}
        got: dict[tuple[int, int], tuple[str, int, str]] = {}

        def run(channel_index: int, length: int) -> None:
            got[(channel_index, length)] = text_and_usage(pb_grpc.WorkerStub(channels[channel_index]), length)

        on_each = [owners.index(pid) for pid in pids]  # a channel of each serving process
        threads = [
            threading.Thread(target=run, args=(on_each[i % len(on_each)], n)) for i, n in enumerate(lengths)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert len(got) == len(lengths)
        for (_, length), result in got.items():
            assert result == reference[length]
            assert result[1] == length and result[2] == pb.LENGTH
    finally:
        for channel in channels:
            channel.close()


def test_a_serving_process_that_dies_ends_the_worker(worker: WorkerProcess) -> None:
    """Killed (as an out-of-memory kill would), another serving process takes the worker down with
    the engine-failure status, for its orchestrator to restart it whole; nothing is left running."""
    [other] = more_serving_pids(worker)
    engine = engine_pid(worker)
    os.kill(other, signal.SIGKILL)
    assert worker.wait_exit(30) == 3, worker.log_tail()
    assert f"serving process 1 (pid {other}) exited with status -9" in worker.log_tail(100)
    assert not alive(engine)


def test_sigterm_drains_every_serving_process(worker: WorkerProcess) -> None:
    """A stream open on the other serving process when the worker is told to stop finishes within
    the grace period; then every process exits and the worker's status is 0."""
    pids = [first_serving_pid(worker), *more_serving_pids(worker)]
    channels, owners = connections_on_each(worker, pids)
    try:
        call = pb_grpc.WorkerStub(channels[owners.index(pids[1])]).Generate(
            chat("Tell me a story.", max_tokens=150, temperature=0.0), timeout=60
        )
        assert next(call).HasField("started")
        next(call)  # a token: the stream is running
        worker.signal(signal.SIGTERM)
        rest = list(call)
        assert [e.finished.reason for e in rest if e.HasField("finished")] == [pb.LENGTH]
        assert worker.wait_exit(30) == 0, worker.log_tail()
        assert not any(alive(pid) for pid in pids[1:]) and not alive(engine_pid(worker))
    finally:
        for channel in channels:
            channel.close()


def test_an_edge_spreads_a_workers_streams_over_its_connections(
    worker: WorkerProcess, tmp_path: Path
) -> None:
    """One edge process with ``--worker-connections 16``: its streams go over 16 connections in
    turn, so both serving processes serve some (all 16 on one of two would be 2 ** -15), and every
    completion is the engine's whole answer."""
    pids = [first_serving_pid(worker), *more_serving_pids(worker)]
    before = {pid: accepted(pid, worker.port) for pid in pids}
    with EdgeProcess([worker.address], log_dir=tmp_path, extra=["--worker-connections", "16"]) as edge:

        def complete(max_tokens: int) -> dict:
            body = {"model": "SmolLM2-135M-Instruct", "prompt": "Tell me about the town.",
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}  # fmt: skip
            response = httpx.post(f"{edge.base_url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(complete, [12] * 32))
        grew = {pid: accepted(pid, worker.port) - before[pid] for pid in pids}
    assert all(grew[pid] > 0 for pid in pids), grew
    texts = {answer["choices"][0]["text"] for answer in answers}
    assert len(texts) == 1 and all(answer["usage"]["completion_tokens"] == 12 for answer in answers)
    assert all(answer["choices"][0]["finish_reason"] == "length" for answer in answers)


def test_a_serving_process_that_cannot_start_fails_the_start_in_one_line() -> None:
    """The engine's end of its pipe closed before it heard ``Ready`` (as when the engine process
    died meanwhile): the serving process exits with the engine-failure status, and the start says
    which process and how in one line, for the first process to log and exit 1."""

    client = SimpleNamespace(pid=os.getpid(), attach=lambda ends: [end.close() for end in ends])
    config = WorkerConfig(api_server_count=2, port=free_port(), log_level="WARNING")
    with pytest.raises(ServingProcessError) as failed:
        ServingProcesses.start(config, client, serving_of_engine)  # type: ignore[arg-type]
    assert str(failed.value) == "--api-server-count: serving process 1 exited with status 3 while starting"
