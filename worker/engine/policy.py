"""The scheduling policies of ``--scheduling-policy`` (``fcfs``, ``priority``, ``fair``): which waiting
request the scheduler tries next, how it orders the running ones, which running request yields to a
waiting one, and which requests are refused at admission as unable to meet their deadline.

Design notes: docs/worker.md ("Scheduling policies").
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from worker.engine.class_stats import ClassStats
from worker.errors import DeadlineUnreachable
from worker.types import Scheduling

# The virtual token counter's weights ("Fairness in Serving Large Language Models", OSDI '24): an
# output token costs twice a prompt token, as the paper (and most price lists) weigh them.
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0
STEP_SMOOTHING = 0.2  # weight of the newest step in the moving average of a step's seconds


class PolicyName(enum.StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    FAIR = "fair"


class PlannedSeq(Protocol):
    """What a policy reads of a sequence (the scheduler's ``SeqState``)."""

    @property
    def finished(self) -> bool: ...

    @property
    def pending(self) -> int: ...

    @property
    def generated(self) -> int: ...


class Queued(Protocol):
    """What a policy reads of a request (the scheduler's ``Schedulable``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def sequences(self) -> Sequence[PlannedSeq]: ...

    @property
    def scheduling(self) -> Scheduling: ...


Q = TypeVar("Q", bound=Queued)


@dataclass(frozen=True)
class Room:
    """The scheduler's limits a policy weighs: sequences at once, and a step's prompt tokens."""

    max_running: int
    budget: int


@dataclass(frozen=True)
class _Ticket:
    order: int  # arrival order (ties of every other key are first come, first served)
    added: float  # the policy's clock at admission
    tenant: str


def _live(item: Queued) -> int:
    return sum(1 for seq in item.sequences if not seq.finished)


class Policy:
    """First come, first served: the queue's order, preemption only for KV blocks (newest first),
    no refusals. The base of the others: tickets, a step's measured seconds, the class metrics."""

    name = PolicyName.FCFS
    bills = False  # whether it keeps count of the tokens each tenant is served (:meth:`charge`)

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.stats = ClassStats()
        self.step_s: float | None = None  # moving average of a busy step's seconds (None: none yet)
        self._tickets: dict[str, _Ticket] = {}
        self._orders = itertools.count()
        self._busy_since: float | None = None  # when the last plan with work was made
        self._unbilled: list[tuple[str, float]] = []  # the last plan's (tenant, cost), charged next tick

    # ------------------------------------------------------------- bookkeeping

    def added(self, item: Queued) -> None:
        """A request entered the queue (after :meth:`admit`)."""
        tenant = item.scheduling.tenant
        self._tickets[item.request_id] = _Ticket(next(self._orders), self.clock(), tenant)

    def forget(self, item: Queued) -> None:
        """A request left the scheduler (ended, cancelled or failed)."""
        self._tickets.pop(item.request_id, None)

    def started(self, item: Queued) -> None:
        """A request's first start: its queue wait is observed."""
        ticket = self._tickets.get(item.request_id)
        if ticket is not None:
            self.stats.observe_queue_wait(item.scheduling, max(0.0, self.clock() - ticket.added))

    def tick(self) -> None:
        """Planning begins: the time since the last busy plan is a step's; that plan's tokens are
        charged (after its checks, so the order a plan was made in is the one it is judged by)."""
        now = self.clock()
        if self._busy_since is not None:
            seconds = now - self._busy_since
            self.step_s = (
                seconds if self.step_s is None else self.step_s + STEP_SMOOTHING * (seconds - self.step_s)
            )
        unbilled, self._unbilled = self._unbilled, []
        for tenant, cost in unbilled:
            self.charge(tenant, cost)

    def planned(self, work: Sequence[Any], running: Sequence[Queued]) -> None:
        """A plan was made: remembers when (if it has work) and what each tenant was served."""
        self._busy_since = self.clock() if work else None
        if not self.bills:
            return
        owner = {id(seq): item.scheduling.tenant for item in running for seq in item.sequences}
        for w in work:
            count = len(w.tokens) - w.proposed
            prompt = max(0, min(w.start + count, w.seq.prompt_length) - w.start)
            cost = INPUT_WEIGHT * prompt + OUTPUT_WEIGHT * (count - prompt + w.proposed)
            self._unbilled.append((owner.get(id(w.seq), ""), cost))

    def charge(self, tenant: str, cost: float) -> None:
        """Tokens served to ``tenant`` (only the fair policy keeps count)."""

    # ------------------------------------------------------------- decisions

    def admit(self, item: Queued, waiting: Sequence[Queued], running: Sequence[Queued], room: Room) -> None:
        """Raises :class:`DeadlineUnreachable` for a request that cannot meet its deadline (never here)."""

    def next_index(self, waiting: Sequence[Queued], running: Sequence[Queued], room: Room) -> int:
        """The position in ``waiting`` of the request to try next."""
        return 0

    def order_running(self, running: list[Any]) -> None:
        """Sorts the running requests into planning order (the last is preempted first for blocks)."""

    def victim(self, head: Q, running: Sequence[Q], room: Room) -> tuple[Q, str] | None:
        """A running request to preempt so that ``head`` can start, with the cause; None: it waits."""
        return None


class PriorityPolicy(Policy):
    """Lower ``priority`` first, then the earlier deadline, then arrival; a waiting request that
    cannot start preempts the running request of the lowest priority below its own."""

    name = PolicyName.PRIORITY

    def key(self, item: Queued) -> tuple[int, float, float]:
        """The order within a tenant: priority, deadline (none: last), arrival (not queued yet: last)."""
        ticket = self._tickets.get(item.request_id)
        deadline = item.scheduling.deadline
        return (
            item.scheduling.priority,
            math.inf if deadline is None else deadline,
            math.inf if ticket is None else ticket.order,
        )

    def admit(self, item: Queued, waiting: Sequence[Queued], running: Sequence[Queued], room: Room) -> None:
        """Refuses a request whose earliest end is past its deadline: the prompt tokens to compute
        before its own (running prompts, and waiting ones ordered before it) and its own, at a
        step's measured pace and a step's prompt budget, then its first token."""
        deadline = item.scheduling.deadline
        if deadline is None or self.step_s is None:
            return
        mine = self.key(item)
        ahead = sum(s.pending for r in running for s in r.sequences if not s.finished and s.pending > 1)
        ahead += sum(_prompt(r) for r in waiting if self.key(r) < mine)
        steps = math.ceil((ahead + _prompt(item)) / max(1, room.budget))
        now = self.clock()
        if now + max(1, steps) * self.step_s > deadline:
            self.stats.deadline_refusals += 1
            raise DeadlineUnreachable(
                f"the request cannot finish before its deadline: about {steps * self.step_s:.2f} s of "
                f"prompt processing is ahead of its first token and {max(0.0, deadline - now):.2f} s remain"
            )

    def next_index(self, waiting: Sequence[Queued], running: Sequence[Queued], room: Room) -> int:
        return min(range(len(waiting)), key=lambda i: self.key(waiting[i]))

    def order_running(self, running: list[Any]) -> None:
        running.sort(key=self.key)

    def victim(self, head: Q, running: Sequence[Q], room: Room) -> tuple[Q, str] | None:
        return self._lower_priority(head, running)

    def _lower_priority(self, head: Q, running: Sequence[Q]) -> tuple[Q, str] | None:
        """The running request (of ``running``) of the lowest priority, if lower than ``head``'s."""
        others = [item for item in running if item is not head]
        if not others:
            return None
        worst = max(others, key=self.key)
        if worst.scheduling.priority > head.scheduling.priority:
            return worst, "priority"
        return None


class FairPolicy(PriorityPolicy):
    """Tenants share the slots and the prompt budget by tokens served (each tenant's virtual token
    counter); within a tenant, :class:`PriorityPolicy`'s order and preemption."""

    name = PolicyName.FAIR
    bills = True

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        super().__init__(clock)
        self.counters: dict[str, float] = {}  # the active tenants' tokens served, weighted

    def added(self, item: Queued) -> None:
        """A tenant that becomes active starts at the least-served active tenant's count (the
        paper's lift: no credit for time away, no debt either)."""
        tenant = item.scheduling.tenant
        if tenant not in self.counters:
            self.counters[tenant] = min(self.counters.values(), default=0.0)
        super().added(item)

    def forget(self, item: Queued) -> None:
        super().forget(item)
        tenant = item.scheduling.tenant
        if all(ticket.tenant != tenant for ticket in self._tickets.values()):
            self.counters.pop(tenant, None)

    def charge(self, tenant: str, cost: float) -> None:
        if tenant in self.counters:
            self.counters[tenant] += cost

    def claims(self, running: Sequence[Queued], room: Room) -> set[str]:
        """Tenants owed a slot now: below an equal share of the slots among active tenants, and not
        ahead of the least-served one by more than a step's prompt budget."""
        if not self.counters:
            return set()
        share = max(1, room.max_running // len(self.counters))
        held = _held(running)
        least = min(self.counters.values())
        return {
            tenant
            for tenant, served in self.counters.items()
            if held.get(tenant, 0) < share and served - least <= room.budget
        }

    def fair_key(self, item: Queued, claims: set[str]) -> tuple[bool, float, tuple[int, float, float]]:
        tenant = item.scheduling.tenant
        return tenant not in claims, self.counters.get(tenant, 0.0), self.key(item)

    def next_index(self, waiting: Sequence[Queued], running: Sequence[Queued], room: Room) -> int:
        claims = self.claims(running, room)
        return min(range(len(waiting)), key=lambda i: self.fair_key(waiting[i], claims))

    def order_running(self, running: list[Any]) -> None:
        running.sort(key=lambda item: (self.counters.get(item.scheduling.tenant, 0.0), self.key(item)))

    def victim(self, head: Q, running: Sequence[Q], room: Room) -> tuple[Q, str] | None:
        """For a tenant owed a slot: the most-served request of the tenant holding the most slots
        above its share (it keeps its share); else a lower priority of ``head``'s own tenant."""
        tenant = head.scheduling.tenant
        if tenant in self.claims(running, room):
            share = max(1, room.max_running // len(self.counters))
            held = _held(running)
            candidates = [
                item
                for item in running
                if item.scheduling.tenant != tenant and held[item.scheduling.tenant] - _live(item) >= share
            ]
            if candidates:
                richest = max(held[item.scheduling.tenant] for item in candidates)
                mine = [item for item in candidates if held[item.scheduling.tenant] == richest]
                return max(mine, key=lambda item: (_served(item), self.key(item))), "fairness"
        return self._lower_priority(head, [item for item in running if item.scheduling.tenant == tenant])


def _held(running: Sequence[Queued]) -> dict[str, int]:
    """Live sequences per tenant."""
    held: dict[str, int] = {}
    for item in running:
        held[item.scheduling.tenant] = held.get(item.scheduling.tenant, 0) + _live(item)
    return held


def _served(item: Queued) -> int:
    return sum(seq.generated for seq in item.sequences)


def _prompt(item: Queued) -> int:
    """The tokens a request's first start computes (its longest live sequence's)."""
    return max((seq.pending for seq in item.sequences if not seq.finished), default=0)


def make_policy(name: str, clock: Callable[[], float] = time.monotonic) -> Policy:
    """The policy named ``name`` (a :class:`PolicyName` value)."""
    classes: dict[PolicyName, type[Policy]] = {
        PolicyName.FCFS: Policy,
        PolicyName.PRIORITY: PriorityPolicy,
        PolicyName.FAIR: FairPolicy,
    }
    return classes[PolicyName(name)](clock)
