"""Speculative verification on hybrid models: a verifying row's tokens pass the recurrent mixers
one position after another, the state after each is kept aside, and the slot takes the state at the
accepted length once the draws are known, so rejected proposals never count in it.

Design notes: docs/worker.md ("The state cache of hybrid models").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from worker.attention.state_pool import StatePool
from worker.model.step_inputs import Work


@dataclass
class Round:
    """One position of a step's decode rows: ``rows`` (indexes into the step's one-token decode
    rows) run together; ``record`` of them (indexes into ``rows``) belong to verifying items and
    their states go to ``kept`` places ``places``."""

    rows: torch.Tensor
    record: torch.Tensor | None = None
    places: torch.Tensor | None = None


@dataclass
class VerifyStates:
    """A step's decode rows in :class:`Round` s, and per recurrent layer the states kept after the
    verifying rows' tokens (``conv[layer]``, ``recurrent[layer]``: ``[places, ...]``); ``slots``:
    each verifying item's state slot and its places, one per token but the last (whose state is the
    slot's own after the forward)."""

    rounds: list[Round]
    slots: dict[int, list[int]]
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)

    def record(self, layer: int, round_: Round, conv: torch.Tensor, recurrent: torch.Tensor | None) -> None:
        """Keeps the states ``round_``'s verifying rows reached in ``layer`` (the round's states)."""
        if round_.record is None or round_.places is None:
            return
        self.conv[layer].index_copy_(0, round_.places, conv.index_select(0, round_.record))
        if recurrent is not None and layer in self.recurrent:
            self.recurrent[layer].index_copy_(0, round_.places, recurrent.index_select(0, round_.record))

    def record_slot(self, layer: int, place: int, pool: StatePool, slot: int) -> None:
        """Keeps pool slot ``slot``'s state in ``layer`` at ``place`` (a batch-invariant step's
        verifying token, worker/model/serial_states.py)."""
        self.conv[layer][place].copy_(pool.conv[layer][slot])
        if layer in self.recurrent:
            self.recurrent[layer][place].copy_(pool.recurrent[layer][slot])

    def keep(self, pool: StatePool, slot: int, accepted: int) -> None:
        """Sets ``slot``'s state to the one after its verifying item's last known token and its
        first ``accepted`` proposals (all accepted: the slot's state already is that one)."""
        places = self.slots.get(slot)
        if places is None or accepted >= len(places):
            return
        live, place = pool.slot_of(slot), places[accepted]
        for layer, kept in self.conv.items():
            pool.conv[layer][live].copy_(kept[place])
        for layer, kept in self.recurrent.items():
            pool.recurrent[layer][live].copy_(kept[place])


def verify_states(items: Sequence[Work], pool: StatePool, device: torch.device) -> VerifyStates | None:
    """The rounds of ``items`` (a step's decode items, in order: each becomes ``1 + proposed``
    one-token rows, :func:`worker.model.step_inputs.token_rows`) with room for their kept states;
    None when none verifies (every row in one round, as before)."""
    if not any(item.proposed for item in items):
        return None
    depth = max(item.proposed for item in items) + 1
    rows: list[list[int]] = [[] for _ in range(depth)]
    record: list[list[tuple[int, int]]] = [[] for _ in range(depth)]  # (place in round, kept place)
    slots: dict[int, list[int]] = {}
    row = places = 0
    for item in items:
        for position in range(1 + item.proposed):
            if position < item.proposed:
                record[position].append((len(rows[position]), places))
                slots.setdefault(item.state_slot, []).append(places)
                places += 1
            rows[position].append(row)
            row += 1
    states = VerifyStates([_round(r, k, device) for r, k in zip(rows, record, strict=True)], slots)
    for layer, tensor in pool.conv.items():
        states.conv[layer] = torch.empty((places, *tensor.shape[1:]), dtype=tensor.dtype, device=device)
    for layer, tensor in pool.recurrent.items():
        states.recurrent[layer] = torch.empty((places, *tensor.shape[1:]), dtype=tensor.dtype, device=device)
    return states


def _round(rows: list[int], record: list[tuple[int, int]], device: torch.device) -> Round:
    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    if not record:
        return Round(index(rows))
    return Round(index(rows), index([r for r, _ in record]), index([p for _, p in record]))
