"""Hand-written Prometheus text exposition (format 0.0.4), shared by the edge and the worker.

Notes: docs/shared.md."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds; fits time to first token and whole-request latencies.
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Seconds; fits the gap between two tokens of one stream.
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

Labels = Mapping[str, str]


@dataclass
class Histogram:
    """A fixed-bucket histogram in the Prometheus style (cumulative buckets, sum, count).

    ``observe`` counts a value into the first bucket whose upper bound is
    ``>=`` the value (Prometheus' ``le``). Not thread-safe: an owner that
    writes from one thread and reads from another reads a :meth:`copy`
    taken under its own lock.
    """

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing, got {self.bounds}")
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
        for bound, count in zip([*map(format_value, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


def escape_label(value: str) -> str:
    """A label value as the text format needs it: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_labels(labels: Labels) -> str:
    """``{a="x",b="y"}``, or ``""`` for no labels."""
    if not labels:
        return ""
    return "{" + ",".join(f'{name}="{escape_label(value)}"' for name, value in labels.items()) + "}"


def format_value(value: float) -> str:
    """A sample value: integers without a decimal point, infinities as ``+Inf``/``-Inf``."""
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def family(name: str, kind: str, help_text: str) -> list[str]:
    """The ``# HELP`` and ``# TYPE`` lines that open a metric family."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def sample(name: str, value: float, labels: Labels | None = None) -> str:
    """One sample line."""
    return f"{name}{format_labels(labels or {})} {format_value(value)}"


def simple_family(name: str, kind: str, help_text: str, samples: Iterable[tuple[Labels, float]]) -> list[str]:
    """A counter or gauge family: header lines, then one line per ``(labels, value)``."""
    return family(name, kind, help_text) + [sample(name, value, labels) for labels, value in samples]


def histogram_family(
    name: str, help_text: str, histogram: Histogram, labels: Labels | None = None
) -> list[str]:
    """A histogram family: header, cumulative ``_bucket`` lines, ``_sum`` and ``_count``."""
    base = dict(labels or {})
    lines = family(name, "histogram", help_text)
    lines += [sample(f"{name}_bucket", count, {**base, "le": le}) for le, count in histogram.cumulative()]
    lines += [sample(f"{name}_sum", histogram.total, base), sample(f"{name}_count", histogram.count, base)]
    return lines


def render(lines: Iterable[str]) -> str:
    """The exposition body: lines joined, ending with a newline (the format requires it)."""
    return "\n".join(lines) + "\n"
