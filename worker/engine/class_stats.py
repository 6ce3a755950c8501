"""Scheduling metrics by class: queue wait and time to first token per (priority, tenant), under a
bounded label set, preemptions by cause and refusals at admission for deadlines.

Design notes: docs/worker.md ("Scheduling policies"); names in docs/observability.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.prometheus import Histogram
from worker.types import Scheduling

# Distinct (priority, tenant) label pairs kept per family; later pairs share ("other", "other").
MAX_CLASSES = 32
OTHER = ("other", "other")


@dataclass
class ClassStats:
    """Histograms by (priority, tenant) label pair, and the counters of the policy's decisions.
    Written under the engine's lock; readers take a :meth:`copy`."""

    queue_wait: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    first_token: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)  # by cause: blocks, priority, fairness
    deadline_refusals: int = 0

    def observe_queue_wait(self, scheduling: Scheduling, seconds: float) -> None:
        _observe(self.queue_wait, scheduling, seconds)

    def observe_first_token(self, scheduling: Scheduling, seconds: float) -> None:
        _observe(self.first_token, scheduling, seconds)

    def preempted(self, cause: str) -> None:
        self.preemptions[cause] = self.preemptions.get(cause, 0) + 1

    def copy(self) -> ClassStats:
        return ClassStats(
            {k: h.copy() for k, h in self.queue_wait.items()},
            {k: h.copy() for k, h in self.first_token.items()},
            dict(self.preemptions),
            self.deadline_refusals,
        )


def labels(scheduling: Scheduling) -> tuple[str, str]:
    """The (priority, tenant) label values of a request (an empty tenant is ``default``)."""
    return str(scheduling.priority), scheduling.tenant or "default"


def _observe(family: dict[tuple[str, str], Histogram], scheduling: Scheduling, seconds: float) -> None:
    """Observes into the request's class, or into ``OTHER`` once ``MAX_CLASSES`` pairs are kept."""
    key = labels(scheduling)
    if key not in family and len(family) >= MAX_CLASSES:
        key = OTHER
    family.setdefault(key, Histogram()).observe(seconds)
