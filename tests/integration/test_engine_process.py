"""``--engine-process``: the worker's gRPC contract with the engine in a process of its own (the
default model's worker tests, run again against such a worker, whose steps also overlap:
``--overlap-steps on``), a grammar, the queue bound, the engine process dying mid-stream, a drain
that stops it, and /metrics answering while the engine process does not."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.integration.test_worker_grpc import (  # noqa: F401  (run again against this module's worker)
    chat,
    stub,
    test_a_repeated_prompt_reuses_its_prefix_and_reports_cached_tokens,
    test_bad_requests_fail_before_any_event_naming_the_problem,
    test_cancelled_call_stops_generation,
    test_deadline_ends_the_call_and_frees_the_sequence,
    test_list_models_health_and_reflection,
    test_max_tokens_gives_length_and_stop_string_is_cut,
    test_raw_prompt_and_token_ids,
    test_stream_is_started_deltas_finished_usage,
    test_tokenize_counts_generates_prompt_and_detokenize_inverts_it,
)
from tests.processes import WorkerProcess
from tests.zygote import ForkedProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def default_worker(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """The default model's worker, its engine in a process of its own, its steps overlapping (as a
    CUDA worker's do by default)."""
    with WorkerProcess(
        cache_dir=model_cache,
        log_dir=tmp_path_factory.mktemp("worker-log"),
        extra=["--engine-process", "--overlap-steps", "on"],
    ) as worker:
        yield worker


def engine_pid(worker: WorkerProcess) -> int:
    """The engine process's pid, from the worker's start-up line."""
    for line in worker.log_tail(400).splitlines():
        if "the engine runs in its own process (pid " in line:
            return int(line.rsplit("pid ", 1)[1].rstrip(")"))
    raise AssertionError(f"no engine process in the log:\n{worker.log_tail()}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_the_engine_runs_in_another_process(default_worker: WorkerProcess) -> None:
    assert default_worker.proc is not None
    pid = engine_pid(default_worker)
    assert pid != default_worker.proc.pid and alive(pid)
    # A worker forked from the tests' zygote has it fork the engine process too (no fresh interpreter).
    forked = isinstance(default_worker.proc, ForkedProcess)
    assert parent_pid(pid) == (parent_pid(default_worker.proc.pid) if forked else default_worker.proc.pid)
    log = default_worker.log_tail(400)
    assert "steps overlap: on (--overlap-steps on)" in log
    for process in ("engine process", "serving process"):  # both heaps out of full collections
        assert re.search(rf"{process}: \d+ objects from start-up left out of garbage collection", log)


def test_a_json_schema_constrains_the_output(stub: pb_grpc.WorkerStub) -> None:  # noqa: F811
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,  # so the object closes within max_tokens
    }
    request = chat("Give me a number as JSON.", max_tokens=40, temperature=0)
    request.response_format.CopyFrom(
        pb.ResponseFormat(json_schema=pb.JsonSchema(schema_json=json.dumps(schema)))
    )
    events = list(stub.Generate(request))
    text = "".join(e.content.text for e in events if e.HasField("content"))
    assert isinstance(json.loads(text)["n"], int)


def test_an_engine_process_that_dies_fails_its_streams_and_the_worker_exits(
    model_cache: Path, tmp_path: Path
) -> None:
    """Killed mid-stream (as an out-of-memory kill or a crashed driver would): the stream ends with
    an error and the worker exits with the device-failure status (its orchestrator restarts it)."""
    worker = WorkerProcess(
        cache_dir=model_cache,
        log_dir=tmp_path,
        extra=["--engine-process", "--fake-tokens", "--fake-step-ms", "20"],
    )
    with worker, grpc.insecure_channel(worker.address) as channel:
        worker_stub = pb_grpc.WorkerStub(channel)
        call = worker_stub.Generate(chat("hi", max_tokens=2000))
        first = next(call)
        assert first.HasField("started")
        next(call)  # a token: the engine is generating
        os.kill(engine_pid(worker), signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as failed:
            for _ in call:
                pass
        # Failed by the engine's end (INTERNAL) or cut by the drain that follows it (UNAVAILABLE),
        # whichever reaches the call first: either way the stream ends at once with an error.
        assert failed.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        assert worker.wait_exit(30) == 3, worker.log_tail()
        assert "the engine process exited" in worker.log_tail(200)
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)


def test_what_the_engine_process_refuses_is_the_callers_error(stub: pb_grpc.WorkerStub) -> None:  # noqa: F811
    """Checked where the request is prepared, in the engine process: the status and the parameter
    come back as from a worker in one process."""
    request = chat("hi", max_tokens=2)
    request.resume.choices.add(ids=[1, 2, 3, 4])  # more resumed tokens than max_tokens
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "4 resumed tokens exceed max_tokens (2)" in str(refused.value.details())


def test_a_full_queue_is_refused_and_a_drain_stops_the_engine_process(
    model_cache: Path, tmp_path: Path
) -> None:
    """The engine process refuses past its queue bound (RESOURCE_EXHAUSTED, as in one process); a
    SIGTERM lets the stream in flight finish, then the worker exits 0 and the engine process is gone."""
    fake = ["--fake-tokens", "--fake-step-ms", "10", "--max-running", "1", "--max-queue", "1"]
    worker = WorkerProcess(cache_dir=model_cache, log_dir=tmp_path, extra=["--engine-process", *fake])
    with worker, grpc.insecure_channel(worker.address) as channel:
        worker_stub = pb_grpc.WorkerStub(channel)
        codes = []
        for call in [worker_stub.Generate(chat("hi", max_tokens=60)) for _ in range(3)]:
            try:
                for _ in call:
                    pass
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                codes.append(error.code())
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
        pid = engine_pid(worker)
        events: list[pb.GenerateResponse] = []
        reading = threading.Thread(
            target=lambda: events.extend(worker_stub.Generate(chat("hi", max_tokens=40)))
        )
        reading.start()
        while not any(e.HasField("content") for e in events):
            time.sleep(0.01)
        worker.signal(signal.SIGTERM)
        reading.join(30)
        assert events[-1].HasField("usage") and events[-2].finished.completion_tokens == 40
        assert worker.wait_exit(30) == 0, worker.log_tail()
        # The frozen heap is unfrozen at exit: shutdown collects it (else nanobind reports leaks).
        assert "leaked" not in worker.log_tail(400)
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)


def test_metrics_answer_while_the_engine_process_does_not(default_worker: WorkerProcess) -> None:
    """A scrape reads the stats the engine process last published and never asks it: frozen
    (SIGSTOP), it still gets an answer at once (the stats it last sent), and health answers too. A
    scrape after a stream's end counts that stream (its end carried them). On the module's worker,
    idle between tests: counted from a scrape before the freeze."""
    before = default_worker.metrics()
    assert before["sluice_worker_running_sequences"] == 0
    pid = engine_pid(default_worker)
    os.kill(pid, signal.SIGSTOP)
    try:
        frozen = default_worker.metrics()
        with grpc.insecure_channel(default_worker.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    finally:
        os.kill(pid, signal.SIGCONT)
    finished = "sluice_worker_requests_finished_total"
    assert frozen[finished] == before[finished] and frozen["sluice_worker_kv_cache_blocks"] > 0
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(default_worker.address) as channel:
        events = list(pb_grpc.WorkerStub(channel).Generate(chat("hi", max_tokens=5, ignore_eos=True)))
    assert events[-2].finished.completion_tokens == 5
    after = default_worker.metrics()
    assert after[finished] == before[finished] + 1
    generated = "sluice_worker_generated_tokens_total"
    assert after[generated] == before[generated] + 5
