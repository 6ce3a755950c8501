"""The batch-invariant mode's all-reduce: every rank's part gathered, then added in rank order, so a
row's sum is the same bits whatever else the tensor holds (gloo's ring and NCCL's algorithms order
it by the tensor's size). Design notes: docs/worker.md, "Tensor parallelism"."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from worker.model.device import RankFailure

AllReduce = Callable[[torch.Tensor], None]
Gather = Callable[[list[torch.Tensor], torch.Tensor], None]


def in_rank_order(parts: list[torch.Tensor], into: torch.Tensor) -> None:
    """Writes ``parts[0] + parts[1] + ... + parts[-1]`` into ``into``, added left to right: each
    element's rounding depends on the ranks' values alone, not on the tensor's shape."""
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    into.copy_(total)


def ordered_all_reduce(ranks: int, gather: Gather | None = None) -> AllReduce:
    """An all-reduce over ``ranks`` that sums in rank order (:func:`in_rank_order`) after
    ``gather`` (torch.distributed's ``all_gather`` on the default group: gloo or NCCL alike),
    moving N-1 parts to every rank where a ring moves about two; raises :class:`RankFailure` as
    :meth:`worker.parallel.group.RankGroup.all_reduce` does."""
    gathered: Gather = gather or _all_gather

    def all_reduce(tensor: torch.Tensor) -> None:
        parts = [torch.empty_like(tensor) for _ in range(ranks)]
        gathered(parts, tensor.contiguous())
        in_rank_order(parts, tensor)

    return all_reduce


def _all_gather(parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
    try:
        dist.all_gather(parts, tensor)
    except Exception as error:
        raise RankFailure(f"a tensor-parallel all-gather failed: {error}") from error
