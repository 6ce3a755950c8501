"""The batched LoRA product of a step: each adapter's tokens shrunk to its rank and expanded back.

The seams for device kernels: :data:`LoraOps` (a Punica/S-LoRA style segmented matmul over a step's
groups, eager steps) and :data:`RowLoraOps` (each row's slot read from a device tensor, so a CUDA
graph can capture it: decode steps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Group:
    """One adapter's share of a step: its slot, its rank, and its tokens' rows of the flat batch
    (a slice where they are contiguous, else an index tensor)."""

    slot: int
    rank: int
    rows: slice | torch.Tensor


# ``ops(x [N, in], a [slots, R, in], b [slots, out, R], groups, out [N, out])`` adds each group's
# ``x[rows] A_slot^T B_slot^T`` to ``out[rows]`` in place.
LoraOps = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[Group], torch.Tensor], None]


def grouped_torch(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: Sequence[Group], out: torch.Tensor
) -> None:
    """The grouped shrink/expand with torch's matrix products: one pair per adapter in the step
    (base-model rows are in no group and untouched)."""
    for group in groups:
        shrink = a[group.slot, : group.rank]  # [r, in]
        expand = b[group.slot, :, : group.rank]  # [out, r]
        if isinstance(group.rows, slice):
            out[group.rows] += (x[group.rows] @ shrink.t()) @ expand.t()
        else:
            delta = (x.index_select(0, group.rows) @ shrink.t()) @ expand.t()
            out.index_add_(0, group.rows, delta)


# ``row_ops(x [N, in], a [slots, R, in], b [slots, out, R], row_slots [N], out [N, out])`` adds
# ``x[i] A_s^T B_s^T`` to ``out[i]`` in place for each row ``i`` of slot ``s = row_slots[i]`` (a
# device tensor; -1: no adapter, the row untouched). Launches must not depend on the slots' values:
# a CUDA graph captures them once and replays them for any mix of adapters.
RowLoraOps = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def slotted_torch(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor, out: torch.Tensor
) -> None:
    """:data:`RowLoraOps` with torch's products, grouped per slot: every slot's shrink and expand
    over all rows, kept for the rows of that slot (``torch.where``, so rows of other slots or none
    are unchanged whatever the products hold). Fixed shapes and no host synchronisation: graph-safe
    (on CUDA, the fallback where the row kernels cannot run; ``slots`` times the rows' products)."""
    for slot in range(a.shape[0]):
        delta = (x @ a[slot].t()) @ b[slot].t()
        out += torch.where((row_slots == slot)[:, None], delta, torch.zeros((), dtype=delta.dtype))
