"""The tensor-parallel ranks' lives: rank 0 starts the followers, each rank loads its shard and builds
its runner alike, the followers then run rank 0's forwards; a follower that exits stops the worker.

Design notes: docs/worker.md, "Tensor parallelism".
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from worker.config import WorkerConfig
from worker.model.device import RankFailure, bind_device
from worker.model.loader import LoadedModel, ModelLoadError, resolve_device
from worker.model.runner import ModelRunner
from worker.model.runner_setup import BatchLimits, load_configured, model_runner
from worker.parallel.group import (
    Accepted,
    Execute,
    Layout,
    RankGroup,
    Relay,
    Score,
    Stop,
    rendezvous_store,
)
from worker.parallel.ordered_sum import ordered_all_reduce
from worker.parallel.quantized_shards import QuantizedShards
from worker.parallel.sharding import Shard, shard_model
from worker.quant.checkpoint_formats import UnsupportedCheckpoint, read_format

log = logging.getLogger(__name__)

# How long a stopping worker waits for its followers to exit before killing them.
STOP_WAIT_S = 10.0
FOLLOWER_MODULE = "worker.parallel.follower"


def rank_config(config: WorkerConfig) -> WorkerConfig:
    """The settings every rank loads and builds with: float weights for ``--quantization auto``
    (its measured choice is for the whole model's shapes; int8/int4/fp8 quantize each rank's
    shards) unless the checkpoint is pre-quantized (served in its own form, each rank's layers cut
    as read)."""
    quantization = config.quantization
    if quantization == "auto" and not _prequantized(config.model):
        quantization = "none"
    return dataclasses.replace(config, quantization=quantization)


def _prequantized(model: str | None) -> bool:
    """Whether ``--model`` is a folder of a pre-quantized checkpoint (one the loader refuses counts:
    its refusal names the format)."""
    folder = None if model is None else Path(model).expanduser()
    if folder is None or not folder.is_dir():
        return False
    try:
        return read_format(folder) is not None
    except UnsupportedCheckpoint:
        return True


def rank_device(device: str, local_rank: int) -> str:
    """The device a rank computes on: the ``local_rank``-th GPU after ``--device``'s, or the CPU."""
    resolved = resolve_device(device)
    if resolved.type != "cuda":
        return "cpu"
    return f"cuda:{(resolved.index or 0) + local_rank}"


def sharded_runner(
    config: WorkerConfig, group: RankGroup, on_progress: Callable[[float], None] | None = None
) -> tuple[LoadedModel, ModelRunner, BatchLimits]:
    """Every rank alike: loads its shard, waits for the others, builds and warms its runner (the
    warm-up's forwards run on every rank together) and checks that the pools match. Rank 0 alone
    reads the tokenizer (a follower only computes: seconds saved per rank for a large vocabulary);
    every rank takes rank 0's context length, which the tokenizer can lower, so the warm-ups match.
    With ``--batch-invariant`` the shards' sums add the ranks' parts in rank order
    (:mod:`worker.parallel.ordered_sum`)."""
    if config.enable_lora and _prequantized(config.model):
        raise ModelLoadError(
            f"--enable-lora with --tensor-parallel-size {config.tensor_parallel_size}: {config.model} is "
            "a pre-quantized checkpoint, whose cut layers the adapters cannot be cut by yet (float "
            "weights, or --quantization int8/int4, are)",
            param="enable_lora",
        )
    layout = group.layout
    summed = ordered_all_reduce(layout.ranks) if config.batch_invariant else group.all_reduce
    shard = Shard(layout.rank, layout.ranks, summed)

    settings = rank_config(config)

    def sharded(model: Any) -> None:
        shard_model(model, shard, settings.quantization)

    device = rank_device(config.device, layout.local_rank)
    lead = layout.rank == 0
    slicer = functools.partial(QuantizedShards, layout.rank, layout.ranks)
    loaded = load_configured(
        settings, on_progress, device=device, shard=sharded, slicer=slicer, tokenizer=lead
    )
    context = group.share(loaded.context_length)  # waits for every rank, as a barrier
    if context != loaded.context_length:
        loaded = dataclasses.replace(loaded, context_length=context)
    bind_device(loaded.device)
    runner, limits = model_runner(loaded, settings)
    group.agree(runner.num_blocks, "the KV pool's blocks")
    agree_on_graphs(group, runner, settings.require_cuda_graphs)
    return loaded, runner, limits


def agree_on_graphs(group: RankGroup, runner: ModelRunner, required: bool) -> None:
    """Every rank replays its captured decode graphs (their all-reduces inside) or none does: a
    replay runs a bucket's padded rows, an eager step its own, so one rank decoding eagerly beside
    replaying ones would all-reduce tensors of other sizes. A rank whose capture failed (the error
    logged) makes every rank drop theirs; ``required`` (--require-cuda-graphs) then fails the load."""
    if group.all_of(runner.graphs is not None, "captured decode graphs") or runner.graphs is None:
        return
    log.error("tensor-parallel rank %d drops its decode graphs: another rank has none", group.layout.rank)
    runner.graphs = None
    if runner.fast_path is not None:
        runner.fast_path = dataclasses.replace(runner.fast_path, graphs=False)
    if required:
        raise ModelLoadError(
            "--require-cuda-graphs: a tensor-parallel rank could not capture its decode graphs",
            param="require_cuda_graphs",
        )


def follow(group: RankGroup, runner: ModelRunner) -> None:
    """A follower's loop: runs each forward rank 0 tells it, until told to stop."""
    while True:
        match group.receive():
            case Execute(work, fed):
                runner.execute(work, None if fed is None else fed.to(runner.device))
            case Score(prompt, top_n, lora):
                runner.score(prompt, top_n, lora)
            case Accepted(item, kept):
                runner.accepted(item, kept)
            case Stop():
                return


class RankProcess(Protocol):
    """A follower rank's process as rank 0 watches it (the part of ``subprocess.Popen`` it uses)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


def fresh_follower(payload: bytes) -> RankProcess:
    """A follower in a fresh interpreter (``python -m worker.parallel.follower``), ``payload`` (its
    pickled settings and place) on its standard input."""
    process = subprocess.Popen([sys.executable, "-m", FOLLOWER_MODULE], stdin=subprocess.PIPE)
    assert process.stdin is not None
    process.stdin.write(payload)
    process.stdin.close()
    return process


# How a follower process starts; the tests' zygote forks one from an imported process instead
# (tests/zygote.py: the same module's main, without seconds of imports).
spawn_follower: Callable[[bytes], RankProcess] = fresh_follower


def start_follower(config: WorkerConfig, layout: Layout) -> RankProcess:
    """Starts one follower rank (:data:`spawn_follower`), its settings and place handed over on its
    standard input."""
    process = spawn_follower(pickle.dumps((config, layout)))
    log.info("tensor-parallel rank %d started (pid %d)", layout.rank, process.pid)
    return process


class Followers:
    """Rank 0's follower processes: watched (one that exits while serving is a :class:`RankFailure`
    for ``on_failure``) and stopped when the worker stops."""

    def __init__(self, processes: dict[int, RankProcess]):
        self._processes = processes
        self._stopping = threading.Event()

    def watch(self, on_failure: Callable[[BaseException], None] | None) -> None:
        for rank, process in self._processes.items():
            threading.Thread(
                target=self._wait, args=(rank, process, on_failure), name=f"sluice-rank-{rank}", daemon=True
            ).start()

    def _wait(
        self, rank: int, process: RankProcess, on_failure: Callable[[BaseException], None] | None
    ) -> None:
        status = process.wait()
        if self._stopping.is_set():
            return
        failure = RankFailure(f"tensor-parallel rank {rank} (pid {process.pid}) exited with status {status}")
        log.error("%s", failure)
        if on_failure is not None:
            on_failure(failure)

    def stop(self, group: RankGroup | None) -> None:
        """Tells the followers to stop (without waiting on a failed one), then ends any left."""
        self._stopping.set()
        if group is not None:
            telling = threading.Thread(target=_tell_stop, args=(group,), daemon=True)
            telling.start()
            telling.join(STOP_WAIT_S / 2)
        for process in self._processes.values():
            try:
                process.wait(STOP_WAIT_S / 2)
            except subprocess.TimeoutExpired:
                process.kill()


def _tell_stop(group: RankGroup) -> None:
    with contextlib.suppress(RankFailure):  # a follower is gone: the others see rank 0's end
        group.send(Stop())


def node_ranks(config: WorkerConfig, node: int) -> list[Layout]:
    """The ranks ``node`` holds (``--tensor-parallel-size`` over ``--nnodes``, as many on each) and
    where they meet: ``--dist-init-addr``, or on one node a free port of 127.0.0.1 (None here)."""
    per_node = config.tensor_parallel_size // config.nnodes
    address = config.dist_init_addr
    first = node * per_node
    return [
        Layout(rank, config.tensor_parallel_size, rank - first, address)
        for rank in range(first, first + per_node)
    ]


def lead_ranks(
    config: WorkerConfig,
    on_progress: Callable[[float], None] | None,
    on_failure: Callable[[BaseException], None] | None,
) -> tuple[LoadedModel, ModelRunner, BatchLimits]:
    """Rank 0: opens the rendezvous, starts its node's followers, loads its shard with every rank,
    and returns its runner, which tells them each forward; a local follower's exit then calls
    ``on_failure`` (another node's ends rank 0's next collective)."""
    ranks = config.tensor_parallel_size
    if config.nnodes > 1:
        host, port = config.dist_init_addr.rsplit(":", 1)
        store = rendezvous_store(host, int(port), ranks)
        address = config.dist_init_addr
    else:
        store = rendezvous_store("127.0.0.1", 0, ranks)
        address = f"127.0.0.1:{store.port}"
    local = [dataclasses.replace(layout, address=address) for layout in node_ranks(config, 0)]
    followers = Followers({layout.rank: start_follower(config, layout) for layout in local[1:]})
    group: RankGroup | None = None
    try:
        group = RankGroup(local[0], resolve_device(rank_device(config.device, 0)), store)
        loaded, runner, limits = sharded_runner(config, group, on_progress)
    except BaseException:
        followers.stop(None)
        raise
    runner.followers = Relay(group, runner.lora)
    followers.watch(on_failure)
    atexit.register(followers.stop, group)
    return loaded, runner, limits


def serve_node(config: WorkerConfig) -> int:
    """A node other than rank 0's (``--node-rank`` above 0): starts its ranks and waits for them;
    when one ends the others are ended too, and its status is the node's (0 once rank 0 stopped
    them all; non-zero makes an orchestrator restart the group)."""
    processes = {
        layout.rank: start_follower(config, layout) for layout in node_ranks(config, config.node_rank)
    }
    ended = threading.Event()
    statuses: list[int] = []

    def wait(process: RankProcess) -> None:
        statuses.append(process.wait())
        ended.set()

    for process in processes.values():
        threading.Thread(target=wait, args=(process,), daemon=True).start()
    ended.wait()
    for process in processes.values():
        if process.poll() is None:
            try:
                process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
    status = next((code for code in statuses if code), 0)
    log.info("node %d's tensor-parallel ranks ended (status %d)", config.node_rank, status)
    return status
