"""Batch-invariant steps on hybrid models (``--batch-invariant``): every token of every item passes
the recurrent mixers alone, one after another over its sequence's slot, by the one-token path, so
its state and output never depend on what else the step holds nor on where its prompt was cut.

Design notes: docs/worker.md ("The state cache of hybrid models").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from worker.attention.state_pool import StatePool
from worker.model.verify_states import VerifyStates

# The mixer over one group of one-token rows: (rows [n, 1, H], pool slots [n], fresh [n]) -> (out, states).
Group = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]


def serial_tokens(
    group: Group,
    layer: int,
    pool: StatePool,
    hidden: torch.Tensor,
    items: Sequence[tuple[int, int, int, int]],
    verify: VerifyStates | None,
) -> torch.Tensor:
    """The mixer of ``layer`` over ``hidden`` ``[1, T, H]``, each item ``(flat start, count, pool
    slot, position)`` token by token; a verifying item's state after each token but its last is
    kept for :meth:`VerifyStates.keep` (as the rounds of a batched step keep it)."""
    out = torch.empty_like(hidden)
    device = hidden.device
    for start, count, slot, position in items:
        slots = torch.tensor([slot], dtype=torch.long, device=device)
        places = [] if verify is None else verify.slots.get(slot, [])
        for i in range(count):
            fresh = torch.tensor([position + i == 0], dtype=torch.bool, device=device)
            token = start + i
            out[:, token : token + 1] = group(hidden[:, token : token + 1], slots, fresh)[0]
            if verify is not None and i < len(places):
                verify.record_slot(layer, places[i], pool, slot)
    return out
