"""Admission and batching decisions: pure Python, no torch, testable without a model.

The scheduler owns two collections: ``waiting`` (a bounded FIFO of admitted
requests) and ``running`` (requests whose sequences are in the batch). Each
engine step asks :meth:`Scheduler.schedule` what to do; the scheduler moves
waiting requests into the batch while there are free sequence slots and the
step's prefill token budget allows, so a burst of long prompts cannot stall
the running streams for more than one bounded prefill per step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from worker.errors import QueueFull


class Schedulable(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def num_sequences(self) -> int: ...

    @property
    def prompt_length(self) -> int: ...


T = TypeVar("T", bound=Schedulable)


@dataclass
class StepPlan(Generic[T]):
    """What one step does: prefill newly admitted requests, then decode the running ones."""

    prefill: list[T] = field(default_factory=list)
    decode: list[T] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler(Generic[T]):
    """FCFS continuous-batching scheduler with a bounded queue and a per-step prefill budget."""

    def __init__(self, max_running: int, max_queue: int, prefill_budget_tokens: int):
        self.max_running = max_running
        self.max_queue = max_queue
        self.prefill_budget_tokens = prefill_budget_tokens
        self.waiting: deque[T] = deque()
        self.running: list[T] = []

    @property
    def running_sequences(self) -> int:
        return sum(item.num_sequences for item in self.running)

    def add(self, item: T) -> None:
        """Queues a request; raises QueueFull (with a retry hint) when the queue is at its bound."""
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(
                f"the worker's queue is full ({self.max_queue} requests waiting); retry later",
                retry_after_seconds=1.0,
            )
        self.waiting.append(item)

    def remove(self, request_id: str) -> T | None:
        """Takes a request out wherever it is (queued or running); returns it, or None if unknown."""
        for index, item in enumerate(self.running):
            if item.request_id == request_id:
                return self.running.pop(index)
        for item in self.waiting:
            if item.request_id == request_id:
                self.waiting.remove(item)
                return item
        return None

    def schedule(self) -> StepPlan[T]:
        plan: StepPlan[T] = StepPlan(decode=list(self.running))
        free = self.max_running - self.running_sequences
        budget = self.prefill_budget_tokens
        while self.waiting:
            head = self.waiting[0]
            if head.num_sequences > free:
                break
            # The first admission of a step always goes through, so a prompt
            # longer than the budget still runs (alone).
            if plan.prefill and head.prompt_length > budget:
                break
            self.waiting.popleft()
            plan.prefill.append(head)
            self.running.append(head)
            free -= head.num_sequences
            budget -= head.prompt_length
        return plan
