"""The edge's Prometheus metrics: what callers experienced, counted where the facts are known.

Three sources, none of which changes what a caller receives:

- an ``after_request`` hook (:meth:`EdgeMetrics.after_request`): one count
  per answered request by route and HTTP status (a stream counts as its 200
  when its headers go out; how it ended is in the stream metrics);
- each stream's pump (:mod:`edge.stream_pump`), which reports what it
  does as it does it: the stream opening and closing (the in-flight gauge; a
  close before the last frame is a client disconnect), the first write that
  carries model output (time to first token, from the request's start), every
  later one (the gap since the previous), and the error it sent by type and
  code;
- worker health, asked of the pool at scrape time (``await pool.health()``).

Role chunks are sent as soon as a worker accepts the call, before any token,
so they are not "first tokens"; a write carrying content, reasoning, a
refusal, a tool-call delta or a choice's finish chunk is. Events that are
ready together go out in one write, which counts once.

Everything runs on the event loop, so plain counters need no lock.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from quart import request
from quart.wrappers import Response

from sluice import prometheus
from sluice.prometheus import GAP_BUCKETS, LATENCY_BUCKETS, Histogram

log = logging.getLogger("sluice.edge.stream")

# Requests that matched no route share one label, so random paths cannot grow the series.
UNMATCHED_ROUTE = "other"


class WorkerHealthLike(Protocol):
    """What the metrics read of one :meth:`WorkerPool.health` entry."""

    @property
    def address(self) -> str: ...

    @property
    def serving(self) -> bool: ...

    @property
    def outstanding(self) -> int: ...


class HealthSource(Protocol):
    """The part of the worker pool the metrics use."""

    async def health(self) -> Sequence[WorkerHealthLike]: ...


class EdgeMetrics:
    """The edge's counters, gauges and histograms, and their exposition."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()  # (route, status)
        self.time_to_first_token = Histogram(LATENCY_BUCKETS)
        self.chunk_gap = Histogram(GAP_BUCKETS)
        self.streams_in_flight = 0
        self.client_disconnects = 0
        self.stream_errors: Counter[tuple[str, str]] = Counter()  # (type, code)

    # ---------------------------------------------------------------- hooks

    async def after_request(self, response: Response) -> Response:
        """Quart hook: counts the answered request by route and status."""
        rule = request.url_rule
        route = rule.rule if rule is not None else UNMATCHED_ROUTE
        self.requests[(route, str(response.status_code))] += 1
        return response

    # ------------------------------------------------- streams (their pumps report)

    def stream_opened(self) -> None:
        self.streams_in_flight += 1

    def stream_closed(self, *, disconnected: bool) -> None:
        """A stream ended; ``disconnected``: before its last frame (the client went away)."""
        self.streams_in_flight -= 1
        if disconnected:
            self.client_disconnects += 1

    def first_output(self, seconds: float) -> None:
        """A stream's first write carrying output, ``seconds`` after its request arrived."""
        self.time_to_first_token.observe(seconds)

    def output_gap(self, seconds: float) -> None:
        """``seconds`` between two writes of one stream that carried output."""
        self.chunk_gap.observe(seconds)

    def stream_error(self, kind: str, code: str) -> None:
        """A stream ended with an ``event: error`` of this type and code."""
        self.stream_errors[(kind, code)] += 1

    # ------------------------------------------------------------ exposition

    async def render(self, pool: HealthSource, concurrency: ConcurrencyStats | None = None) -> str:
        """The Prometheus text: this edge's metrics, then each worker's health as seen now."""
        health = await pool.health()
        lines = prometheus.simple_family(
            "sluice_edge_requests_total",
            "counter",
            "HTTP requests answered, by route and status (a stream counts when its headers go out)",
            [({"route": route, "status": status}, n) for (route, status), n in sorted(self.requests.items())],
        )
        lines += prometheus.histogram_family(
            "sluice_edge_time_to_first_token_seconds",
            "seconds from a stream request's arrival to its first output chunk",
            self.time_to_first_token,
        )
        lines += prometheus.histogram_family(
            "sluice_edge_inter_chunk_gap_seconds",
            "seconds between consecutive output chunks of one stream",
            self.chunk_gap,
        )
        lines += prometheus.simple_family(
            "sluice_edge_streams_in_flight",
            "gauge",
            "SSE responses being sent",
            [({}, self.streams_in_flight)],
        )
        lines += prometheus.simple_family(
            "sluice_edge_client_disconnects_total",
            "counter",
            "streams that ended before their last frame (the client went away, or shutdown cut them)",
            [({}, self.client_disconnects)],
        )
        lines += prometheus.simple_family(
            "sluice_edge_stream_errors_total",
            "counter",
            "event: error frames sent mid-stream, by error type and code",
            [({"type": kind, "code": code}, n) for (kind, code), n in sorted(self.stream_errors.items())],
        )
        lines += prometheus.simple_family(
            "sluice_edge_worker_up",
            "gauge",
            "1 when the worker answers its health check SERVING, else 0",
            [({"address": w.address}, int(w.serving)) for w in health],
        )
        lines += prometheus.simple_family(
            "sluice_edge_worker_outstanding_requests",
            "gauge",
            "calls this edge has open on the worker",
            [({"address": w.address}, w.outstanding) for w in health],
        )
        if concurrency is not None:
            lines += prometheus.simple_family(
                "sluice_edge_concurrency_slots_in_use",
                "gauge",
                "generation requests holding a per-key concurrency slot",
                [({}, concurrency.in_use())],
            )
            lines += prometheus.simple_family(
                "sluice_edge_concurrency_rejections_total",
                "counter",
                "generation requests refused (429) by the per-key concurrency limit",
                [({}, concurrency.rejected)],
            )
        return prometheus.render(lines)


class ConcurrencyStats(Protocol):
    """What the metrics read of :class:`edge.concurrency.ConcurrencyLimiter`."""

    rejected: int

    def in_use(self, identity: str | None = None) -> int: ...
