"""The batched LoRA product as Triton kernels: for eager steps over the step's adapter segments
(Punica's SGMV shrink ``x A^T`` and expand ``· B^T``); for the decode graphs per row (Punica's BGMV:
each row's slot read from a device tensor, the grid independent of the adapter mix). Imports triton.

Design notes: docs/worker.md ("LoRA adapters").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from worker.lora.ops import Group

BLOCK_M = 16  # rows of a segment per program (tl.dot's smallest)
BLOCK_K = 32  # input features per step of the shrink's loop
BLOCK_N = 64  # output features per expand program


@triton.jit
def shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    rows_ptr,
    starts_ptr,
    lengths_ptr,
    slots_ptr,
    stride_x,
    stride_a_slot,
    stride_a_rank,
    stride_h,
    features,
    rank,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``h[rows] = x[rows] A_slot^T`` for one block of one segment's rows (float32 sums)."""
    segment = tl.program_id(0)
    start = tl.load(starts_ptr + segment)
    length = tl.load(lengths_ptr + segment)
    slot = tl.load(slots_ptr + segment).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < length
    rows = tl.load(rows_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    rank_mask = offs_r < rank
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < features
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + slot * stride_a_slot + offs_r[None, :] * stride_a_rank + offs_k[:, None],
            mask=k_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    tl.store(
        h_ptr + rows[:, None] * stride_h + offs_r[None, :], acc, mask=row_mask[:, None] & rank_mask[None, :]
    )


@triton.jit
def expand_kernel(
    h_ptr,
    b_ptr,
    out_ptr,
    rows_ptr,
    starts_ptr,
    lengths_ptr,
    slots_ptr,
    stride_h,
    stride_b_slot,
    stride_b_out,
    stride_out,
    outputs,
    rank,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """``out[rows] += h[rows] B_slot^T`` for one block of one segment's rows and outputs."""
    segment = tl.program_id(0)
    start = tl.load(starts_ptr + segment)
    length = tl.load(lengths_ptr + segment)
    slot = tl.load(slots_ptr + segment).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < length
    rows = tl.load(rows_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < outputs
    offs_r = tl.arange(0, BLOCK_R)
    rank_mask = offs_r < rank
    h = tl.load(
        h_ptr + rows[:, None] * stride_h + offs_r[None, :],
        mask=row_mask[:, None] & rank_mask[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + slot * stride_b_slot + offs_n[None, :] * stride_b_out + offs_r[:, None],
        mask=rank_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    delta = tl.dot(h, b.to(tl.float32), input_precision="ieee")
    where = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    base = tl.load(where, mask=mask, other=0.0)
    tl.store(where, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


class Segments:
    """A step's groups as the kernels read them: every group's rows one after another (``rows``),
    each group's ``starts``, ``lengths`` and ``slots``, and its longest length."""

    def __init__(self, groups: Sequence[Group], device: torch.device):
        pieces = [
            torch.arange(g.rows.start, g.rows.stop) if isinstance(g.rows, slice) else g.rows.cpu()
            for g in groups
        ]
        lengths = [len(piece) for piece in pieces]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        self.rows = torch.cat(pieces).to(device=device, dtype=torch.int32)
        self.starts = torch.tensor(starts, dtype=torch.int32, device=device)
        self.lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.slots = torch.tensor([g.slot for g in groups], dtype=torch.int32, device=device)
        self.longest = max(lengths)


class TritonLora:
    """:data:`worker.lora.ops.LoraOps` on the two kernels; a step's segments are built once and
    reused by every layer (the groups of one plan are one tuple)."""

    def __init__(self) -> None:
        self._groups: Sequence[Group] | None = None
        self._segments: Segments | None = None

    def segments(self, groups: Sequence[Group], device: torch.device) -> Segments:
        if self._segments is None or groups is not self._groups:
            self._groups, self._segments = groups, Segments(groups, device)
        return self._segments

    def __call__(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: Sequence[Group], out: torch.Tensor
    ) -> None:
        if not groups:
            return
        seg = self.segments(groups, x.device)
        rank = a.shape[1]
        block_r = max(16, triton.next_power_of_2(rank))
        x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
        h = torch.empty(x.shape[0], rank, dtype=torch.float32, device=x.device)
        blocks = triton.cdiv(seg.longest, BLOCK_M)
        shrink_kernel[(len(groups), blocks)](
            x, a, h, seg.rows, seg.starts, seg.lengths, seg.slots,
            x.stride(0), a.stride(0), a.stride(1), h.stride(0), x.shape[1], rank,
            BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
        )  # fmt: skip
        expand_kernel[(len(groups), blocks, triton.cdiv(out.shape[1], BLOCK_N))](
            h, b, out, seg.rows, seg.starts, seg.lengths, seg.slots,
            h.stride(0), b.stride(0), b.stride(1), out.stride(0), out.shape[1], rank,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r,
        )  # fmt: skip


# The per-row kernels hold a ``rank x BLOCK`` tile in registers: at most this many elements.
ROW_TILE = 8192


@triton.jit
def shrink_rows_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    slots_ptr,
    stride_x,
    stride_a_slot,
    stride_a_rank,
    stride_h,
    features,
    rank,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``h[row] = x[row] A_slot^T`` for one row, its slot read from ``slots`` (float32 sums; a row
    of slot -1 reads no weights and gets zeros)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    used_rank = tl.where(slot >= 0, rank, 0)  # a row of no slot reads none of A (its h is zeros)
    slot = tl.maximum(slot, 0)
    offs_r = tl.arange(0, BLOCK_R)
    rank_mask = offs_r < used_rank
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < features
        x = tl.load(x_ptr + row * stride_x + offs_k, mask=k_mask, other=0.0)
        a = tl.load(
            a_ptr + slot * stride_a_slot + offs_r[:, None] * stride_a_rank + offs_k[None, :],
            mask=rank_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(h_ptr + row * stride_h + offs_r, acc, mask=offs_r < rank)


@triton.jit
def expand_rows_kernel(
    h_ptr,
    b_ptr,
    out_ptr,
    slots_ptr,
    stride_h,
    stride_b_slot,
    stride_b_out,
    stride_out,
    outputs,
    rank,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """``out[row] += h[row] B_slot^T`` for one row and block of outputs; a row of slot -1 is left
    as it is (nothing loaded or stored)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    used_outputs = tl.where(slot >= 0, outputs, 0)  # a row of no slot: every output masked off
    slot = tl.maximum(slot, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < used_outputs
    offs_r = tl.arange(0, BLOCK_R)
    rank_mask = offs_r < rank
    h = tl.load(h_ptr + row * stride_h + offs_r, mask=rank_mask, other=0.0)
    b = tl.load(
        b_ptr + slot * stride_b_slot + offs_n[:, None] * stride_b_out + offs_r[None, :],
        mask=n_mask[:, None] & rank_mask[None, :],
        other=0.0,
    )
    delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    where = out_ptr + row * stride_out + offs_n
    base = tl.load(where, mask=n_mask, other=0.0)
    tl.store(where, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=n_mask)


def row_blocks(rank: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_K, BLOCK_N)`` of the per-row kernels for slots of ``rank``: the rank's
    power of two, and input and output blocks that keep a tile within :data:`ROW_TILE`."""
    block_r = max(16, triton.next_power_of_2(rank))
    return block_r, max(16, min(128, ROW_TILE // block_r)), max(16, min(64, ROW_TILE // block_r))


class TritonRowLora:
    """:data:`worker.lora.ops.RowLoraOps` on the two per-row kernels: one shrink program per row
    and one expand program per row and output block, whatever the rows' slots (graph-safe)."""

    def __call__(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor, out: torch.Tensor
    ) -> None:
        rows, rank = x.shape[0], a.shape[1]
        block_r, block_k, block_n = row_blocks(rank)
        x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
        h = torch.empty(rows, rank, dtype=torch.float32, device=x.device)
        shrink_rows_kernel[(rows,)](
            x, a, h, row_slots, x.stride(0), a.stride(0), a.stride(1), h.stride(0), x.shape[1], rank,
            BLOCK_R=block_r, BLOCK_K=block_k,
        )  # fmt: skip
        expand_rows_kernel[(rows, triton.cdiv(out.shape[1], block_n))](
            h, b, out, row_slots, h.stride(0), b.stride(0), b.stride(1), out.stride(0), out.shape[1], rank,
            BLOCK_N=block_n, BLOCK_R=block_r,
        )  # fmt: skip
