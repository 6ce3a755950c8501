"""The CUDA-only paths' fallbacks, checked where there is no GPU: they say no, they do not crash."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from worker.attention import triton_decode
from worker.attention.decode_kernel import kernel_works
from worker.attention.kv_pool import KVShape
from worker.model import cuda_graphs


def cpu_runner() -> SimpleNamespace:
    return SimpleNamespace(
        kv_shape=KVShape.uniform(2, 3, 64, torch.float32, group=3),
        device=torch.device("cpu"),
        block_size=16,
    )


def test_the_kernel_check_fails_closed_when_the_kernel_cannot_run(caplog):
    # CPU tensors without triton's interpreter: the kernel cannot launch, so the gather path is kept.
    with caplog.at_level(logging.ERROR):
        runner = cpu_runner()
        assert kernel_works(runner.kv_shape, runner.block_size, runner.device) is False
    assert "decode attention gathers instead" in caplog.text


def test_no_graphs_without_triton(monkeypatch, caplog):
    monkeypatch.setattr(triton_decode, "triton_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert cuda_graphs.capture_decode_graphs(cpu_runner(), 8, 512) is None  # type: ignore[arg-type]
    assert "decode runs eagerly" in caplog.text


def test_buckets_cover_every_batch_size_up_to_max_running():
    runner = SimpleNamespace(
        device=torch.device("cpu"), block_size=16, scratch_block=9, kv_shape=None, states=None
    )
    graphs = cuda_graphs.DecodeGraphs(runner, 100, 4096)  # type: ignore[arg-type]
    assert graphs.buckets[-1] == 100 and graphs.buckets == sorted(graphs.buckets)
    assert all(graphs.fits(rows) for rows in range(1, 101)) and not graphs.fits(101)
    assert graphs.tables.shape == (100, 256) and graphs.tables.dtype == torch.int32


def test_with_lora_the_start_up_says_what_the_graphs_hold(caplog):
    from worker.lora.ops import slotted_torch
    from worker.model.runner_setup import log_graph_scope

    kernel = SimpleNamespace(row_ops=object())  # the Triton row kernels
    with caplog.at_level(logging.INFO, logger="worker.model.runner_setup"):
        log_graph_scope(SimpleNamespace(lora=None, graphs=object()))  # type: ignore[arg-type]
        log_graph_scope(SimpleNamespace(lora=kernel, graphs=None))  # type: ignore[arg-type]
        assert caplog.text == ""
        log_graph_scope(SimpleNamespace(lora=kernel, graphs=SimpleNamespace(adapters=True)))  # type: ignore[arg-type]
        assert "adapter slot is a graph input, so decode steps with adapter rows replay" in caplog.text
        assert "on the Triton row kernels" in caplog.text
        caplog.clear()
        torch_rows = SimpleNamespace(row_ops=slotted_torch)
        log_graph_scope(SimpleNamespace(lora=torch_rows, graphs=SimpleNamespace(adapters=True)))  # type: ignore[arg-type]
        assert "on torch, every slot's over all rows" in caplog.text
        caplog.clear()
        log_graph_scope(SimpleNamespace(lora=kernel, graphs=SimpleNamespace(adapters=False)))  # type: ignore[arg-type]
    assert "base-model decode steps only; a step with LoRA adapter rows runs eagerly" in caplog.text
