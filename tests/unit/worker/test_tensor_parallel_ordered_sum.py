"""``--tensor-parallel-size`` with ``--batch-invariant`` (worker/parallel/ordered_sum.py): the setting
is no longer refused, and the ordered all-reduce gives a row the same bits whatever the tensor
around it, as three ranks' parts added left to right, where a sum whose order depends on the
element's place in the tensor (gloo's ring chunks it by the tensor's size) does not."""

from __future__ import annotations

import torch

from worker.config import WorkerConfig
from worker.parallel.ordered_sum import ordered_all_reduce

RANKS = 3


def parts_of(rows: int) -> list[torch.Tensor]:
    """Three ranks' partial outputs: the same first row (one of each), then ``rows`` others."""
    generator = torch.Generator().manual_seed(0)
    row = [torch.randn(1, 64, generator=generator, dtype=torch.bfloat16) for _ in range(RANKS)]
    others = torch.randn(RANKS, rows, 64, generator=generator, dtype=torch.bfloat16)
    return [torch.cat([row[rank], others[rank]]) for rank in range(RANKS)]


def summed(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rank 0's result of the ordered all-reduce, the gather handed the ranks' parts."""

    def gather(into: list[torch.Tensor], tensor: torch.Tensor) -> None:
        assert torch.equal(tensor, parts[0])
        for slot, part in zip(into, parts, strict=True):
            slot.copy_(part)

    tensor = parts[0].clone()
    ordered_all_reduce(RANKS, gather)(tensor)
    return tensor


def chunked(parts: list[torch.Tensor]) -> torch.Tensor:
    """A ring-like sum: each of three chunks of the flat tensor starts at another rank."""
    flat = [part.flatten() for part in parts]
    bounds = torch.linspace(0, flat[0].numel(), RANKS + 1).long().tolist()
    out = torch.empty_like(flat[0])
    for chunk in range(RANKS):
        lo, hi = bounds[chunk], bounds[chunk + 1]
        order = [(chunk + step) % RANKS for step in range(RANKS)]
        total = flat[order[0]][lo:hi].clone()
        for rank in order[1:]:
            total += flat[rank][lo:hi]
        out[lo:hi] = total
    return out.reshape(parts[0].shape)


def test_batch_invariant_is_served_under_tensor_parallelism() -> None:
    problems = WorkerConfig(tensor_parallel_size=3, batch_invariant=True).problems()
    assert not [problem for problem in problems if "batch-invariant" in problem]


def test_a_rows_ordered_sum_is_the_same_bits_in_any_batch_where_a_chunked_one_is_not() -> None:
    alone = parts_of(0)
    want = (alone[0] + alone[1]) + alone[2]
    assert torch.equal(summed(alone), want)
    ordered = [summed(parts_of(rows))[:1] for rows in range(1, 12)]
    assert all(torch.equal(row, want) for row in ordered)
    chunked_rows = [chunked(parts_of(rows))[:1] for rows in range(1, 12)]
    assert any(not torch.equal(row, chunked(alone)) for row in chunked_rows)
