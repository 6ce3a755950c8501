"""The CUDA path's defects (issue 25), shown on the CPU with fakes where the CPU can show them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import weakref
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import LlamaConfig, LlamaForCausalLM

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from worker import metrics, server
from worker.attention import paged
from worker.attention.kv_pool import KVPool, KVShape
from worker.attention.variants import PLAIN
from worker.config import parse_config
from worker.engine.core import Engine
from worker.engine.stats import EngineCounters, EngineStats
from worker.model import cuda_graphs, device, runner_setup
from worker.model.fake_runner import FakeRunner, load_fake_model
from worker.model.loader import ModelLoadError
from worker.types import FastPath

pytestmark = pytest.mark.slow  # left out of make test-fast

# ------------------------------------------------------------------ 3: loud fallbacks


def test_the_fast_path_metric_says_which_part_is_off() -> None:
    fast = FastPath(kernel=True, graphs=False, fused=True)
    stats = EngineStats(0, 0, 0, 0, 0, 0, 0, EngineCounters(), fast_path=fast)
    text = metrics.render(stats, "m")
    assert 'sluice_worker_fast_path{model="m",part="kernel"} 1.0' in text
    assert 'sluice_worker_fast_path{model="m",part="graphs"} 0.0' in text
    assert 'sluice_worker_fast_path{model="m",part="fused"} 1.0' in text
    assert 'part="quant"' not in text  # a float model has no quantized layers to report
    assert "sluice_worker_decode_graph_replays_total" in text
    assert "sluice_worker_decode_graph_lora_replays" not in text  # only with --enable-lora
    with_lora = EngineStats(
        0, 0, 0, 0, 0, 0, 0, EngineCounters(), fast_path=fast, max_loras=2, graph_lora_replays=7
    )
    assert 'sluice_worker_decode_graph_lora_replays_total{model="m"} 7.0' in metrics.render(with_lora, "m")
    quantized = EngineStats(
        0, 0, 0, 0, 0, 0, 0, EngineCounters(), fast_path=FastPath(True, True, True, False)
    )
    assert 'sluice_worker_fast_path{model="m",part="quant"} 0.0' in metrics.render(quantized, "m")
    cpu = metrics.render(EngineStats(0, 0, 0, 0, 0, 0, 0, EngineCounters()), "m")
    assert "sluice_worker_fast_path" not in cpu  # no fast path to report off the GPU


def test_require_cuda_graphs_refuses_to_start_without_them() -> None:
    loaded = SimpleNamespace(device=torch.device("cpu"))
    config = parse_config(["--require-cuda-graphs"], environ={})
    with pytest.raises(ModelLoadError, match="--require-cuda-graphs"):
        runner_setup.model_runner(loaded, config)  # type: ignore[arg-type]
    config = parse_config(["--require-cuda-graphs", "--no-cuda-graphs"], environ={})
    cuda = SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(ModelLoadError, match="--no-cuda-graphs"):
        runner_setup.model_runner(cuda, config)  # type: ignore[arg-type]


def test_a_missing_triton_is_an_error_line_with_its_cost(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    from worker.attention import decode_kernel, triton_decode

    monkeypatch.setattr(triton_decode, "triton_available", lambda: False)
    shape = KVShape.uniform(1, 2, 64, torch.float32, group=2)
    with caplog.at_level(logging.ERROR):
        assert decode_kernel.kernel_problem(shape, 16, torch.device("cpu")) == "triton is not installed"
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "slower" in record.getMessage() and "without CUDA graphs" in record.getMessage()


# ------------------------------------------------------------------ 4: scratch lifetime


@contextmanager
def fake_cuda_capture(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """torch.cuda's capture API as no-ops, so capture's Python side runs on the CPU."""

    class Graph:
        def replay(self) -> None:
            pass

    @contextmanager
    def nothing(*_: Any, **__: Any):  # type: ignore[no-untyped-def]
        yield

    stream = SimpleNamespace(wait_stream=lambda other: None)
    for name, value in {
        "graph_pool_handle": lambda: None,
        "Stream": lambda: stream,
        "current_stream": lambda: stream,
        "stream": nothing,
        "CUDAGraph": Graph,
        "graph": nothing,
        "synchronize": lambda *a: None,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    yield


def test_each_captured_graph_holds_the_split_scratch_it_writes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen: dict[int, Any] = {}

    def model(input_ids: torch.Tensor, **_: Any) -> Any:
        step = paged.STEP.value
        assert step is not None
        [(_plan, workspace)] = step.decode_kernel.parts.values()
        seen[input_ids.shape[0]] = weakref.ref(workspace.partial_out)
        return SimpleNamespace(logits=torch.zeros((input_ids.shape[0], 1, 8)))

    shape = KVShape.uniform(1, 1, 16, torch.float32)
    runner = SimpleNamespace(
        model=model,
        device=torch.device("cpu"),
        block_size=16,
        scratch_block=0,
        kv_shape=shape,
        pool=KVPool(shape, 2, 16, torch.device("cpu")),
        states=None,
    )
    with fake_cuda_capture(monkeypatch):
        graphs = cuda_graphs.DecodeGraphs(runner, 4, 8192)  # type: ignore[arg-type]
        graphs.capture()
    import gc

    gc.collect()
    for rows in graphs.buckets:  # small buckets of a long context split K
        workspace = seen[rows]()
        assert workspace is not None, f"the scratch of bucket {rows} was freed while its graph lives"
        [(_plan, kept)] = graphs.captured[rows].kernel.parts.values()
        assert kept is not None and kept.partial_out is workspace


# ------------------------------------------------------------------ 5: a failed device


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_device_error_makes_the_worker_not_serving_and_exit_non_zero(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def broken(self: FakeRunner, work: Any, fed: Any = None) -> torch.Tensor:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(FakeRunner, "execute", broken)
    # Not in this test process: the freeze would keep every fixture alive now out of collections.
    monkeypatch.setattr(server, "freeze_startup_heap", lambda log, what: 0)
    port = free_port()
    config = parse_config(["--fake-tokens", "--port", str(port), "--host", "127.0.0.1"], environ={})
    health_seen: list[int] = []

    async def main() -> tuple[int, grpc.StatusCode | None]:
        worker = asyncio.ensure_future(server.run(config))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(600):
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                await asyncio.sleep(0.1)
            request = pb.GenerateRequest(
                chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hello")]),
                sampling=pb.SamplingParams(max_tokens=4),
            )
            code = None
            try:
                async for _ in pb_grpc.WorkerStub(channel).Generate(request, timeout=30):
                    pass
            except grpc.RpcError as error:
                code = error.code()
            with_health = asyncio.ensure_future(health.Check(health_pb2.HealthCheckRequest(), timeout=5))
            status = await asyncio.wait_for(worker, 30)
            with contextlib.suppress(grpc.RpcError):  # the server had already stopped
                health_seen.append((await with_health).status)
        return status, code

    status, code = asyncio.run(main())
    assert status == server.EXIT_ENGINE_FAILED != 0
    assert code is not None
    assert all(s == health_pb2.HealthCheckResponse.NOT_SERVING for s in health_seen)


def test_device_errors_are_told_from_request_errors() -> None:
    assert device.is_fatal_device_error(torch.AcceleratorError("CUDA error: device-side assert triggered"))
    assert device.is_fatal_device_error(RuntimeError("CUDA error: unspecified launch failure"))
    assert not device.is_fatal_device_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert not device.is_fatal_device_error(ValueError("bad shape"))


# ------------------------------------------------------------------ 6: cuda:N in every thread


def test_every_thread_that_touches_cuda_sets_the_device(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, torch.device(d)))
    )
    gpu1 = torch.device("cuda:1")
    # The loader thread: it builds the pool, checks the kernel and captures the graphs.
    loaded = SimpleNamespace(device=gpu1, model=None, tokenizer=None, task="generate")
    monkeypatch.setattr(server, "load_configured", lambda *a, **k: loaded)

    def model_runner(*_: Any) -> Any:
        assert calls and calls[-1] == ("loader", gpu1), "the device was not set before the runner"
        raise ModelLoadError("stop here")

    monkeypatch.setattr(server, "model_runner", model_runner)
    failures: list[BaseException] = []

    def load() -> None:
        try:
            server.build_serving(parse_config(["--device", "cuda:1"], environ={}))
        except ModelLoadError as error:
            failures.append(error)

    thread = threading.Thread(target=load, name="loader")
    thread.start()
    thread.join(30)
    assert failures and "stop here" in str(failures[0])
    # The engine thread: it runs every forward, the Triton kernel and the graph replays.
    fake = load_fake_model(None, served_model_name=None, cache_dir=parse_config([], environ={}).cache_dir)
    runner = FakeRunner(fake, num_blocks=8, block_size=16)
    runner.device = gpu1
    engine = Engine(runner, fake.tokenizer, eos_token_ids=[], context_length=64)
    engine.start()
    engine.stop()
    assert ("sluice-engine", gpu1) in calls


# ------------------------------------------------------------------ 7: 4-D SDPA for prompt chunks


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_prompt_chunks_and_the_memory_probe_run_sdpa_on_4d_tensors(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ranks: list[int] = []
    original = paged.F.scaled_dot_product_attention

    def recording(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        ranks.append(query.dim())
        return original(query, *args, **kwargs)

    monkeypatch.setattr(paged.F, "scaled_dot_product_attention", recording)
    shape = KVShape.uniform(1, 2, 16, torch.float32)
    pool = KVPool(shape, 4, 4, torch.device("cpu"))
    pool.keys[0].normal_()
    pool.values[0].normal_()
    query = torch.randn(5, 4, 16)
    chunk = paged.Chunk(0, 5, 9, torch.tensor([2, 0, 3]))
    got = paged._chunk(chunk, query, pool.layers[0], 0.25, PLAIN)
    keys = pool.keys[0][[2, 0, 3]].flatten(0, 1)[:9].repeat_interleave(2, dim=1)  # [9, 4, 16]
    values = pool.values[0][[2, 0, 3]].flatten(0, 1)[:9].repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) * 0.25
    scores = scores.masked_fill(~paged.chunk_mask(5, 9, 1, torch.device("cpu")), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert ranks == [4]
    ranks.clear()
    model = tiny_model()
    loaded = SimpleNamespace(model=model, device=torch.device("cpu"), dtype=torch.float32, context_length=256)
    runner_setup.take_activation_memory(loaded, 32, 16)  # type: ignore[arg-type]
    assert ranks == [4], "the start-up probe must take the chunk path serving takes"


def test_graph_inputs_are_staged_for_the_used_columns_only() -> None:
    """A replayed step's inputs (here on the CPU: the buffers and copies, not the replay): the
    rows' ids, positions, slots and lengths, the block tables' used columns, and padding rows that
    write the scratch slot and read nothing. The table is not rebuilt context_length wide."""
    from worker.model.step_inputs import Work

    runner = SimpleNamespace(device=torch.device("cpu"), block_size=4, scratch_block=99, states=None)
    graphs = cuda_graphs.DecodeGraphs(runner, max_rows=8, context_length=64)  # type: ignore[arg-type]
    assert graphs.tables.shape == (8, 16)
    graphs.tables.fill_(7)  # entries an earlier, longer step left behind
    work = [Work([11], 5, [3, 4, 5], True), Work([12], 0, [6], True), Work([13], 8, [1, 2, 9], True)]
    bucket = graphs.stage(work)
    assert bucket == 4
    assert graphs.ids[:4, 0].tolist() == [11, 12, 13, 0]
    assert graphs.positions[:4, 0].tolist() == [5, 0, 8, 0]
    assert graphs.slots[:4].tolist() == [4 * 4 + 1, 6 * 4, 9 * 4, 99 * 4]
    assert graphs.lengths[:4].tolist() == [6, 1, 9, 0]
    assert graphs.tables[:3, :3].tolist() == [[3, 4, 0], [6, 0, 0], [1, 2, 9]]
    assert graphs.tables[:3, 3:].eq(7).all()  # past every row's length: left as it was, never read


def test_cuda_takes_cudnn_out_of_sdpa_and_the_cpu_leaves_it() -> None:
    """cuDNN builds an execution plan per new attention shape (a step's prompts make new ones all the
    time): on CUDA the worker turns it off process-wide; elsewhere nothing changes."""
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        device.prefer_planless_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        device.prefer_planless_attention(torch.device("cuda", 1))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)
