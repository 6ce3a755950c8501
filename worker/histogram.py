"""A fixed-bucket histogram in the Prometheus style (cumulative buckets, sum, count).

Written by the engine thread only; read by the metrics endpoint, which copies
it under the engine's lock.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total, self.count)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le label, cumulative count) pairs, ending with +Inf."""
        out, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out
