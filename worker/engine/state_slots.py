"""Which running sequence holds which slot of a hybrid model's state pool (bookkeeping only: the
tensors are worker/attention/state_pool.py's).

Design notes: docs/worker.md ("The state cache of hybrid models").
"""

from __future__ import annotations


class StateSlots:
    """``count`` slots, one per running sequence: a sequence takes one when it is first planned
    (or planned again after a preemption) and gives it back when it finishes, is preempted or
    removed. The scheduler runs at most ``count`` sequences, so a slot is always free for one."""

    def __init__(self, count: int):
        self.count = count
        self._free = list(range(count - 1, -1, -1))  # popped from the end: lowest first

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError(f"every one of the {self.count} state slots is held")
        return self._free.pop()

    def give(self, slot: int) -> None:
        """Returns ``slot`` (-1, no slot, is ignored)."""
        if slot < 0:
            return
        if slot in self._free or slot >= self.count:
            raise RuntimeError(f"state slot {slot} given back twice or unknown")
        self._free.append(slot)


def reuses_prefixes(runner: object, wanted: bool) -> bool:
    """Whether the prefix cache may serve ``runner``'s sequences: not a hybrid model's (a runner
    with a state pool), whose sequence cannot start past position 0 without the state there."""
    return wanted and getattr(runner, "states", None) is None
