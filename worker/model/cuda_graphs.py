"""Decode steps captured as CUDA graphs at padded batch-size buckets (CUDA only), a hybrid
model's state slots and each row's LoRA adapter slot among their inputs.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from worker.attention import paged, triton_decode
from worker.attention.decode_kernel import DecodeKernel, decode_kernel
from worker.attention.kv_pool import KVPool, KVShape
from worker.attention.state_pool import StatePool
from worker.device.staging import staged
from worker.lora.layers import LoraLayers, LoraPlan
from worker.model.recurrent import StateStep, state_step
from worker.model.step_inputs import Work, decode_inputs

log = logging.getLogger(__name__)

EAGER_COST = (
    "decode runs eagerly, without CUDA graphs (one kernel launch per operator: several times "
    "slower per decode step at small batches)"
)


class GraphedRunner(Protocol):
    """What capturing and replaying decode steps reads of the runner
    (:class:`worker.model.runner.ModelRunner`)."""

    model: Any
    device: torch.device
    block_size: int
    scratch_block: int
    kv_shape: KVShape
    pool: KVPool
    states: StatePool | None
    lora: LoraLayers | None

    def execute(self, work: Sequence[Work], fed: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class CapturedStep:
    """One bucket's graph with everything its replays write or read besides the shared inputs:
    the logits it fills and the decode kernel (whose split-K scratch the graph writes)."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    kernel: DecodeKernel


BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


class StateInputs:
    """A hybrid model's part of the graphs' inputs: each row's state slot in the pool and whether
    its sequence starts there (its state zeroed first), padding rows on the scratch slot. The mixers
    gather, update and scatter the slots' states on the device (worker/model/recurrent.py), so a
    replay reads and writes the slots these buffers name."""

    def __init__(self, pool: StatePool, rows: int, device: torch.device):
        self.pool = pool
        self.slots = torch.full((rows,), pool.scratch, dtype=torch.long, device=device)
        self.fresh = torch.ones((rows,), dtype=torch.bool, device=device)

    def step(self, rows: int) -> StateStep:
        """The state step a ``rows``-row bucket is captured with (views of the buffers)."""
        return StateStep(self.pool, decode_slots=self.slots[:rows], decode_fresh=self.fresh[:rows])

    def stage(self, work: Sequence[Work], bucket: int) -> None:
        """Writes ``work``'s slots and fresh flags (one host tensor, one copy), padding to ``bucket``."""
        rows = len(work)
        host = [[self.pool.slot_of(item.state_slot), int(item.start == 0)] for item in work]
        packed = staged(host, torch.long, self.slots.device)
        self.slots[:rows].copy_(packed[:, 0])
        self.fresh[:rows].copy_(packed[:, 1] != 0)
        if bucket > rows:
            self.slots[rows:bucket].fill_(self.pool.scratch)
            self.fresh[rows:bucket].fill_(True)


class LoraInputs:
    """With --enable-lora, the graphs' input naming each row's adapter slot (-1: the base model; so
    are padding rows). The wrapped layers read it on the device (:class:`LoraLayers.rows_step`,
    per-row kernels whose launches do not depend on it), and the slots' weights are fixed tensors
    an adapter is copied into in place, so a replay computes the adapters the buffer names now."""

    def __init__(self, layers: LoraLayers, rows: int, device: torch.device):
        self.layers = layers
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=device)

    def stage(self, plan: LoraPlan | None, rows: int, bucket: int) -> bool:
        """Writes the step's row slots from ``plan`` (the runner's, of these ``rows``; None: all
        base rows) and -1 for the padding to ``bucket``; whether any row uses an adapter."""
        if plan is None or not plan.groups:
            self.slots[:bucket].fill_(-1)
            return False
        if len(plan.row_slots) != rows:
            raise RuntimeError(f"a LoRA step planned {len(plan.row_slots)} rows, the graph got {rows}")
        self.slots[:rows].copy_(staged(list(plan.row_slots), torch.long, self.slots.device))
        if bucket > rows:
            self.slots[rows:bucket].fill_(-1)
        return True


class DecodeGraphs:
    """Captured decode steps; :meth:`run` replays the smallest bucket that holds a step."""

    def __init__(self, runner: GraphedRunner, max_rows: int, context_length: int):
        self.runner = runner
        device = runner.device
        self.buckets = [b for b in BUCKETS if b < max_rows] + [max_rows]
        self.max_rows = max_rows
        size = runner.block_size
        self.width = -(-context_length // size)
        rows = max_rows
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.slots = torch.zeros((rows,), dtype=torch.long, device=device)
        self.tables = torch.zeros((rows, self.width), dtype=torch.int32, device=device)
        self.lengths = torch.zeros((rows,), dtype=torch.int32, device=device)
        self.scratch_slot = runner.scratch_block * size
        self.states = None if runner.states is None else StateInputs(runner.states, rows, device)
        layers = getattr(runner, "lora", None)
        self.lora = None if layers is None else LoraInputs(layers, rows, device)
        self.captured: dict[int, CapturedStep] = {}
        self.replays = 0  # decode steps served by a replay (a metric; the GPU check compares it)
        self.adapter_replays = 0  # of which with a LoRA adapter row (the GPU check reports it)
        self._adapter_rows = False  # the staged step has a LoRA adapter row

    @property
    def adapters(self) -> bool:
        """Whether the graphs take the rows' LoRA slots as inputs (steps with adapter rows replay)."""
        return self.lora is not None

    def fits(self, rows: int) -> bool:
        return rows <= self.max_rows

    def capture(self) -> None:
        """Captures every bucket, the largest first (the rest reuse its memory pool)."""
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        self.slots.fill_(self.scratch_slot)
        for rows in sorted(self.buckets, reverse=True):
            kernel = decode_kernel(
                rows, self.runner.kv_shape, self.width, self.runner.block_size, self.runner.device
            )
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up runs (autotuning, allocator) before capture
                    self.forward(rows, kernel)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(rows, kernel)
            # The graph writes the kernel's scratch on every replay: it lives as long as the graph.
            self.captured[rows] = CapturedStep(graph, logits, kernel)
        torch.cuda.synchronize()
        log.info(
            "captured decode CUDA graphs for %d batch sizes (up to %d rows%s) in %.1fs",
            len(self.buckets),
            self.max_rows,
            (", state slots as inputs" if self.states is not None else "")
            + (", LoRA adapter slots as inputs" if self.lora is not None else ""),
            time.monotonic() - started,
        )

    @torch.inference_mode()
    def forward(self, rows: int, kernel: DecodeKernel | None) -> torch.Tensor:
        """The decode forward of a ``rows``-row bucket over the buffers (what a graph captures):
        float32 logits ``[rows, vocab]``; ``kernel``: the Triton decode kernel (None: the gather path,
        which the CPU tests run)."""
        step = paged.PagedStep(
            pool=self.runner.pool,
            slots=self.slots[:rows],
            decode_tables=self.tables[:rows],
            decode_lengths=self.lengths[:rows],
            decode_kernel=kernel,
        )
        if kernel is None:
            step.decode_mask = paged.decode_mask(self.lengths[:rows], self.width * self.runner.block_size)
        states = None if self.states is None else self.states.step(rows)
        with paged.paged_step(step), state_step(states), self._lora_step(rows):
            out = self.runner.model(
                input_ids=self.ids[:rows], position_ids=self.positions[:rows], use_cache=False
            )
        return out.logits[:, -1].float()

    def _lora_step(self, rows: int) -> AbstractContextManager[None]:
        """The wrapped layers reading the rows' slots from the buffer (nothing without LoRA)."""
        if self.lora is None:
            return nullcontext()
        return self.lora.layers.rows_step(self.lora.slots[:rows])

    def run(self, work: Sequence[Work], fed: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [rows, vocab] of a decode step of ``len(work)`` rows: a view of the bucket's
        captured output, which its next replay overwrites (the engine samples before that);
        ``fed``: see :meth:`ModelRunner.execute`."""
        bucket = self.stage(work, fed)
        captured = self.captured[bucket]
        captured.graph.replay()
        self.replays += 1
        self.adapter_replays += self._adapter_rows
        return captured.logits[: len(work)]

    def stage(self, work: Sequence[Work], fed: torch.Tensor | None = None) -> int:
        """Writes the step's inputs into the graphs' buffers; returns the bucket to replay. One host
        tensor and one copy (decode_inputs), then copies on the device; the block tables get only
        the columns the step's contexts use (the kernel reads no entry past a row's length, so older
        entries further right are never read), not the ``context_length`` wide table."""
        rows = len(work)
        bucket = next(b for b in self.buckets if b >= rows)
        inputs = decode_inputs(work, self.runner.block_size, self.runner.device, torch.int32, fed)
        self.ids[:rows].copy_(inputs.ids)
        self.positions[:rows].copy_(inputs.positions)
        self.slots[:rows].copy_(inputs.slots)
        self.lengths[:rows].copy_(inputs.lengths)
        self.tables[:rows, : inputs.tables.shape[1]].copy_(inputs.tables)
        if bucket > rows:  # padding rows: token 0 at position 0, written to the scratch slot, no context
            self.ids[rows:bucket].zero_()
            self.positions[rows:bucket].zero_()
            self.slots[rows:bucket].fill_(self.scratch_slot)
            self.lengths[rows:bucket].zero_()
        if self.states is not None:
            self.states.stage(work, bucket)
        self._adapter_rows = False
        if self.lora is not None:
            plan = self.lora.layers.plan  # the runner's step over these rows (LoraLayers.step)
            self._adapter_rows = self.lora.stage(plan if isinstance(plan, LoraPlan) else None, rows, bucket)
        return bucket


def capture_decode_graphs(runner: GraphedRunner, max_rows: int, context_length: int) -> DecodeGraphs | None:
    """Captured graphs for decode steps of up to ``max_rows`` rows, or None (eager decode, logged at
    ERROR with the reason and its cost) when triton is missing or capture fails."""
    if not triton_decode.triton_available():
        log.error("triton is not installed: %s", EAGER_COST)
        return None
    graphs = DecodeGraphs(runner, max_rows, context_length)
    try:
        graphs.capture()
        # One replay against the same step run eagerly (both write only the scratch block).
        work = [Work([1], 0, [runner.scratch_block], True)]
        replayed = graphs.run(work).clone()
        eager = runner.execute(work)
    except Exception:
        log.exception("capturing decode CUDA graphs failed: %s", EAGER_COST)
        return None
    if not torch.allclose(replayed, eager, rtol=1e-2, atol=1e-2 * float(eager.abs().max()) + 1e-3):
        log.error("a replayed decode graph disagrees with the eager step: %s", EAGER_COST)
        return None
    graphs.replays = graphs.adapter_replays = 0  # the metrics count the engine's steps, not this check's
    return graphs
