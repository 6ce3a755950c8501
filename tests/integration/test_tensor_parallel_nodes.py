"""Two "nodes" on 127.0.0.1 (``--nnodes 2``, ``--node-rank``, ``--dist-init-addr``): node 0's rank 0
serves, node 1's rank joins it; both generate, and node 0's stop ends node 1 with status 0."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import NodeProcess, WorkerProcess, free_port

pytestmark = pytest.mark.integration


def test_a_rank_on_a_second_node_joins_rank_zero_and_ends_with_it(
    model_cache: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    nodes = ["-tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    leader = WorkerProcess(
        cache_dir=model_cache, log_dir=tmp_path, model=str(tiny_model_dir), extra=[*nodes, "--node-rank", "0"]
    )
    node = NodeProcess(
        ["--model", str(tiny_model_dir), "--torch-threads", "1", *nodes, "--node-rank", "1"], tmp_path
    )
    try:
        node.launch()
        with leader, grpc.insecure_channel(leader.address) as channel:
            request = pb.GenerateRequest(
                prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=[5, 17, 300, 41])),
                sampling=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                return_token_ids=True,
            )
            events = list(pb_grpc.WorkerStub(channel).Generate(request, timeout=60))
            ids = [i for e in events if e.WhichOneof("event") == "content" for i in e.content.token_ids]
            assert len(ids) == 8
        assert node.wait_exit(30) == 0, node.log_tail()
    finally:
        node.kill()
    text = node.log_tail(400)
    assert "tensor-parallel rank 1 of 2 joined (gloo)" in text
    assert "node 1's tensor-parallel ranks ended (status 0)" in text
    assert "tensor-parallel rank 1 started" not in leader.log_tail(400)  # node 0 started no follower
