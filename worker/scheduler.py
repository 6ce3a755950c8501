"""Admission and batching decisions: pure Python, no torch, testable without a model.

The scheduler owns two collections: ``waiting`` (a bounded FIFO of admitted
requests) and ``running`` (requests whose sequences are in the batch). Each
engine step asks :meth:`Scheduler.schedule` what to do. A waiting request
joins the batch when all of these hold:

- a sequence slot is free for each of its choices (``max_running``);
- its token reservation fits: every sequence reserves its prompt plus its
  ``max_tokens``, so the KV cache can never outgrow ``max_batch_tokens``;
- the step's prefill budget allows it: new prompts are prefilled together,
  left-padded to the longest, so a step costs (new prompts) x (longest new
  prompt) tokens, and that cost is kept under ``prefill_budget_tokens``. A
  prompt's length here is what the prefill must compute (``prefill_cost``:
  the engine leaves out the tokens the prefix cache already holds). A burst
  of long prompts therefore cannot stall the running streams for more than
  one bounded prefill per step. The first admission of a step always goes
  through, so a prompt longer than the budget still runs (alone).

Admission is first come, first served: a request that does not fit blocks the
ones behind it, so a large request is never starved by small ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from worker.errors import InvalidRequest, QueueFull


class Schedulable(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def num_sequences(self) -> int: ...

    @property
    def prompt_length(self) -> int: ...

    @property
    def reserved_tokens(self) -> int: ...


T = TypeVar("T", bound=Schedulable)


@dataclass
class StepPlan(Generic[T]):
    """What one step does: prefill newly admitted requests, then decode the running ones."""

    prefill: list[T] = field(default_factory=list)
    decode: list[T] = field(default_factory=list)
    # Waiting requests whose planning raised (their prefill cost): out of the queue, to be failed alone.
    failed: list[tuple[T, Exception]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler(Generic[T]):
    """FCFS continuous-batching scheduler with a bounded queue, token reservations and a prefill budget."""

    def __init__(
        self,
        max_running: int,
        max_queue: int,
        prefill_budget_tokens: int,
        max_batch_tokens: int,
        prefill_cost: Callable[[T], int] | None = None,
    ):
        """``prefill_cost(item)``: the prompt tokens its prefill computes (default: all of them)."""
        self.max_running = max_running
        self.max_queue = max_queue
        self.prefill_budget_tokens = prefill_budget_tokens
        self.max_batch_tokens = max_batch_tokens
        self._prefill_cost = prefill_cost or (lambda item: item.prompt_length)
        self.waiting: deque[T] = deque()
        self.running: list[T] = []

    @property
    def running_sequences(self) -> int:
        return sum(item.num_sequences for item in self.running)

    @property
    def reserved_tokens(self) -> int:
        return sum(item.reserved_tokens for item in self.running)

    def add(self, item: T) -> None:
        """Queues a request.

        Raises InvalidRequest when the request could never fit the batch, and
        QueueFull (with a retry hint) when the queue is at its bound.
        """
        if item.reserved_tokens > self.max_batch_tokens:
            raise InvalidRequest(
                f"the request needs {item.reserved_tokens} tokens of cache (prompt + max_tokens, times n), "
                f"more than this worker's limit of {self.max_batch_tokens}; lower max_tokens or n",
                param="max_tokens",
            )
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
        free_slots = self.max_running - self.running_sequences
        free_tokens = self.max_batch_tokens - self.reserved_tokens
        longest = 0
        while self.waiting:
            head = self.waiting[0]
            if head.num_sequences > free_slots or head.reserved_tokens > free_tokens:
                break
            try:
                cost = self._prefill_cost(head)
            except Exception as error:  # this request alone cannot be planned
                self.waiting.popleft()
                plan.failed.append((head, error))
                continue
            padded_cost = (len(plan.prefill) + 1) * max(longest, cost)
            if plan.prefill and padded_cost > self.prefill_budget_tokens:
                break
            self.waiting.popleft()
            plan.prefill.append(head)
            self.running.append(head)
            free_slots -= head.num_sequences
            free_tokens -= head.reserved_tokens
            longest = max(longest, cost)
        return plan
