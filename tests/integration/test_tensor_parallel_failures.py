"""A follower rank killed with SIGKILL stops a ``--tensor-parallel-size 2`` worker cleanly: a stream
in flight ends with an error, the worker leaves SERVING and exits with the device-failure status
within 30 s, never a hang; idle (no collective to notice) as well as mid-stream, with the engine in
the worker's process or in its own."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import WorkerProcess

pytestmark = pytest.mark.integration

EXIT_DEVICE_FAILED = 3


def follower_pid(worker: WorkerProcess) -> int:
    """Rank 1's pid, from rank 0's start-up line."""
    for line in worker.log_tail(400).splitlines():
        if "tensor-parallel rank 1 started (pid " in line:
            return int(line.rsplit("pid ", 1)[1].rstrip(")"))
    raise AssertionError(f"no follower in the log:\n{worker.log_tail()}")


def long_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=[5, 17, 300, 41])),
        sampling=pb.SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True),
    )


def test_a_follower_killed_mid_stream_fails_the_stream_and_the_worker_exits(
    model_cache: Path, long_tiny_model_dir: Path, tmp_path: Path
) -> None:
    worker = WorkerProcess(
        cache_dir=model_cache, log_dir=tmp_path, model=str(long_tiny_model_dir), extra=["-tp", "2"]
    )
    with worker, grpc.insecure_channel(worker.address) as channel:
        call = pb_grpc.WorkerStub(channel).Generate(long_request(), timeout=60)
        assert next(call).HasField("started")
        next(call)  # a token: the ranks are generating
        os.kill(follower_pid(worker), signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as failed:
            for _ in call:
                pass
        assert failed.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        assert worker.wait_exit(30) == EXIT_DEVICE_FAILED, worker.log_tail()
        assert "tensor-parallel" in worker.log_tail(200)
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)


def test_a_follower_killed_while_idle_stops_an_engine_process_worker(
    model_cache: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    worker = WorkerProcess(
        cache_dir=model_cache,
        log_dir=tmp_path,
        model=str(tiny_model_dir),
        extra=["-tp", "2", "--engine-process"],
    )
    with worker:
        os.kill(follower_pid(worker), signal.SIGKILL)
        assert worker.wait_exit(30) == EXIT_DEVICE_FAILED, worker.log_tail()
        assert "tensor-parallel rank 1 (pid" in worker.log_tail(200)
