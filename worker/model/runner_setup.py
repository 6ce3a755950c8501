"""From a loaded model to a warm runner: the KV pool's size, the batch limits that follow from it,
and the warm-up (CUDA graphs on CUDA) that runs before the worker reports SERVING.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from worker.attention import paged
from worker.attention.kv_pool import KVPool, kv_shape, pool_blocks
from worker.config import WorkerConfig
from worker.lora.ops import slotted_torch
from worker.model.cuda_graphs import capture_decode_graphs
from worker.model.device import prefer_planless_attention
from worker.model.fake_runner import DEFAULT_TOKENS, FakeRunner
from worker.model.fused import fuse_for_serving
from worker.model.loader import LoadedModel, ModelLoadError, load_model
from worker.model.mixer_kernels import checked_mixer_kernels
from worker.model.recurrent import state_slot_bytes
from worker.model.runner import ModelRunner
from worker.model.step_inputs import FlatTokens, Work
from worker.quant import cuda_kernels
from worker.quant.slicing import Slicer
from worker.types import FastPath

log = logging.getLogger(__name__)

CPU_MAX_RUNNING = 16
MAX_RUNNING_CUDA = 512
TOKENS_PER_SEQUENCE = 256
CPU_PREFILL_TOKENS = 1024
CUDA_PREFILL_TOKENS = 2048
# A hybrid model on CUDA without --max-running: as many state slots as this share of the memory
# budget holds (at most MAX_RUNNING_CUDA); the KV pool gets the rest.
STATE_SHARE = 0.25


@dataclass(frozen=True)
class BatchLimits:
    max_running: int
    prefill_tokens: int


def cpu_batch_hint(config: WorkerConfig) -> int:
    """The batch size CPU-side weight layouts are prepared for (before the pool exists)."""
    return config.max_running or CPU_MAX_RUNNING


def prefill_tokens(config: WorkerConfig, device: torch.device) -> int:
    if config.max_prefill_tokens is not None:
        return config.max_prefill_tokens
    return CUDA_PREFILL_TOKENS if device.type == "cuda" else CPU_PREFILL_TOKENS


def batch_limits(config: WorkerConfig, device: torch.device, pool_tokens: int) -> BatchLimits:
    """The running-sequence and prefill limits: the settings when given, else from the device and
    the pool (see docs/worker.md)."""
    running = config.max_running
    if running is None:
        if device.type == "cuda":
            running = max(CPU_MAX_RUNNING, min(MAX_RUNNING_CUDA, pool_tokens // TOKENS_PER_SEQUENCE))
        else:
            running = CPU_MAX_RUNNING
    return BatchLimits(running, prefill_tokens(config, device))


def fake_runner(loaded: LoadedModel, config: WorkerConfig) -> FakeRunner:
    tokens = config.max_batch_tokens or DEFAULT_TOKENS
    size = config.kv_block_size
    return FakeRunner(
        loaded,
        num_blocks=-(-tokens // size),
        block_size=size,
        step_ms=config.fake_step_ms,
        vocab=config.fake_vocab,
    )


def load_configured(
    config: WorkerConfig,
    on_progress: Callable[[float], None] | None = None,
    *,
    device: str | None = None,
    shard: Callable[[Any], None] | None = None,
    slicer: Callable[[Any], Slicer] | None = None,
    tokenizer: bool = True,
) -> LoadedModel:
    """The model the settings name, loaded as they say (on ``device`` instead of ``--device`` when
    given; ``shard``, ``slicer`` and ``tokenizer``: a tensor-parallel rank's, see
    :func:`worker.model.loader.load_model`)."""
    return load_model(
        config.model,
        served_model_name=config.served_model_name,
        device=device or config.device,
        dtype=config.dtype,
        cache_dir=config.cache_dir,
        quantization=config.quantization,
        batch_hint=cpu_batch_hint(config),
        task=config.task,
        on_progress=on_progress,
        shard=shard,
        slicer=slicer,
        tokenizer=tokenizer,
    )


def model_runner(loaded: LoadedModel, config: WorkerConfig) -> tuple[ModelRunner, BatchLimits]:
    """Sizes the pool, builds the runner and warms it up (captures CUDA graphs on CUDA); with
    ``--require-cuda-graphs``, raises :class:`ModelLoadError` rather than fall back to a slower path."""
    device = loaded.device
    if config.require_cuda_graphs and (device.type != "cuda" or not config.cuda_graphs):
        why = "--no-cuda-graphs was given" if device.type == "cuda" else f"the device is {device}"
        raise ModelLoadError(
            f"--require-cuda-graphs needs CUDA graphs, but {why}", param="require_cuda_graphs"
        )
    mixers_on_kernels = checked_mixer_kernels(loaded.model, config.require_mixer_kernels)
    budget = prefill_tokens(config, device)
    ranks = config.tensor_parallel_size
    prefer_planless_attention(device)
    fused = device.type == "cuda" and config.fused_kernels and fuse_for_serving(loaded.model)
    if device.type == "cuda":
        take_activation_memory(loaded, budget, config.kv_block_size, config.kv_cache_dtype, ranks)
    shape = kv_shape(loaded.model.config, loaded.dtype, config.kv_cache_dtype).per_rank(ranks)
    state_slots, fraction = state_split(loaded, config)
    blocks = pool_blocks(
        shape,
        config.kv_block_size,
        device,
        tokens=config.max_batch_tokens,
        cpu_bytes=config.kv_cache_bytes,
        gpu_memory_fraction=fraction,
    )
    limits = batch_limits(config, device, blocks * config.kv_block_size)
    if state_slots is not None:
        limits = BatchLimits(state_slots, limits.prefill_tokens)
    runner = ModelRunner(
        loaded,
        num_blocks=blocks,
        block_size=config.kv_block_size,
        batch_invariant=config.batch_invariant,
        max_sequences=limits.max_running,
        kv_cache_dtype=config.kv_cache_dtype,
        ranks=ranks,
    )
    runner.mixers_on_kernels = mixers_on_kernels
    if config.enable_lora:  # before the warm-up and graph capture, which then hold the wrapped layers
        runner.enable_lora(config.max_loras, config.max_lora_rank)
    if runner.states is not None:
        log.info(
            "memory: KV cache %.2f GiB, state cache %.1f MiB (%d slots and %d prefix checkpoints of "
            "%.3f MiB over %d recurrent layers)",
            runner.pool_bytes / 2**30,
            runner.state_bytes / 2**20,
            runner.states.slots,
            runner.states.checkpoints,
            runner.states.slot_bytes / 2**20,
            len(runner.states.shapes),
        )
    if config.require_cuda_graphs and not runner.decode_kernel_enabled:
        raise ModelLoadError(
            f"--require-cuda-graphs: the Triton decode kernel is off ({runner.kernel_problem})",
            param="require_cuda_graphs",
        )
    warm_up(runner)
    if device.type == "cuda":
        if config.cuda_graphs and runner.decode_kernel_enabled:
            runner.graphs = capture_decode_graphs(runner, limits.max_running, loaded.context_length)
            log_graph_scope(runner)
        runner.fast_path = FastPath(
            kernel=runner.decode_kernel_enabled,
            graphs=runner.graphs is not None,
            fused=fused,
            quant=cuda_kernels.on_kernels(runner.model),
        )
        if config.require_cuda_graphs and runner.graphs is None:
            raise ModelLoadError(
                "--require-cuda-graphs: capturing the decode CUDA graphs failed (the error above)",
                param="require_cuda_graphs",
            )
    log.info(
        "batch limits: %d running sequences, %d prompt tokens per step",
        limits.max_running,
        limits.prefill_tokens,
    )
    return runner, limits


def log_graph_scope(runner: ModelRunner) -> None:
    """With --enable-lora, says at start-up what the captured decode graphs hold: each row's adapter
    slot as an input (decode steps with adapter rows replay them), with which per-row product."""
    if runner.lora is not None and runner.graphs is not None:
        if not runner.graphs.adapters:
            log.info(
                "CUDA graphs: captured for base-model decode steps only; a step with LoRA adapter "
                "rows runs eagerly (adapter slots are not graph inputs)"
            )
            return
        kernels = runner.lora.row_ops is not slotted_torch
        log.info(
            "CUDA graphs: each row's LoRA adapter slot is a graph input, so decode steps with "
            "adapter rows replay graphs too (per-row products on %s); prompt chunks and mixed "
            "steps run eagerly",
            "the Triton row kernels" if kernels else "torch, every slot's over all rows",
        )


def state_split(loaded: LoadedModel, config: WorkerConfig) -> tuple[int | None, float]:
    """A hybrid model's state slots (None: no recurrent layers) and the memory fraction left to the
    KV pool on CUDA: --max-running slots, or on CUDA as many as :data:`STATE_SHARE` of the budget
    holds, or on the CPU :data:`CPU_MAX_RUNNING` (the state pool is allocated beside
    --kv-cache-bytes there)."""
    device = loaded.device
    slot_bytes = state_slot_bytes(loaded.model, device, loaded.dtype)
    if not slot_bytes:
        return None, config.gpu_memory_fraction
    if device.type != "cuda":
        return config.max_running or CPU_MAX_RUNNING, config.gpu_memory_fraction
    free, _total = torch.cuda.mem_get_info(device)
    budget = free * config.gpu_memory_fraction
    slots = config.max_running or max(1, min(MAX_RUNNING_CUDA, int(budget * STATE_SHARE) // (2 * slot_bytes)))
    # Each slot, the scratch slot, as many prefix checkpoints as slots (recurrent.state_pool), and
    # the states a speculative step keeps per verified token (verify_states.verify_states).
    kept = config.speculative_rows * config.num_speculative_tokens
    return slots, max(0.0, (budget - (2 * slots + 1 + kept) * slot_bytes) / free)


@torch.inference_mode()
def take_activation_memory(
    loaded: LoadedModel, tokens: int, block_size: int, cache: str = "auto", ranks: int = 1
) -> None:
    """One forward of a full prefill budget as a prompt chunk continuing a cached prefix, through the
    paged attention in a pool of its own (the path and SDPA kernels serving takes), so the pool is
    sized from what is left."""
    device = loaded.device
    count = max(1, min(tokens, loaded.context_length - block_size))
    context = min(loaded.context_length, count + max(block_size, count))
    shape = kv_shape(loaded.model.config, loaded.dtype, cache).per_rank(ranks)
    blocks = -(-context // block_size)
    pool = KVPool(shape, blocks, block_size, device)
    work = Work([0] * count, context - count, list(range(blocks)), True)
    flat = FlatTokens.of([work], block_size)
    chunk = paged.Chunk(0, count, context, torch.arange(blocks, dtype=torch.long, device=device))
    step = paged.PagedStep(pool=pool, slots=flat.slot_tensor(device), chunks=[chunk])
    paged.register()
    loaded.model.set_attn_implementation(paged.NAME)
    with paged.paged_step(step):
        loaded.model(
            input_ids=torch.tensor([flat.ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([flat.positions], dtype=torch.long, device=device),
            use_cache=False,
            # A tensor, as serving passes: an int makes Gemma 4 cut its KV-sharing layers' queries.
            logits_to_keep=torch.tensor([count - 1], dtype=torch.long, device=device),
        )
    del pool, step, chunk
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def warm_up(runner: ModelRunner) -> None:
    """One prompt chunk and one decode step through the pool (the first request then meets warm
    kernels and allocator). It writes block 0 only, which every sequence overwrites before it reads."""
    prompt = max(1, runner.block_size - 1)  # fits block 0 with room for the decoded token
    if prompt > 1:
        runner.execute([Work([1] * prompt, 0, [0], True)])
    runner.execute([Work([1], prompt if prompt > 1 else 0, [0], True)])
