"""The edge's Prometheus metrics: what callers experienced, counted where the facts are known.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Protocol

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, values
from quart import request
from quart.wrappers import Response

from edge.rate_limits import KINDS as RATE_LIMITS
from edge.workers.migration import OUTCOMES as MIGRATION_OUTCOMES
from sluice.prometheus import GAP_BUCKETS, LATENCY_BUCKETS

log = logging.getLogger("sluice.edge.stream")

# Requests that matched no route share one label, so random paths cannot grow the series.
UNMATCHED_ROUTE = "other"
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"

# No "_created" series: they double the output and nobody here reads them.
prometheus_client.disable_created_metrics()


def use_multiprocess_dir(folder: str) -> None:
    """Makes the metrics created from now on (in this process and the ones it forks) keep their
    values in ``folder``, shared by every process of one edge. Call before any app is built."""
    os.environ[MULTIPROCESS_ENV] = folder
    values.ValueClass = values.MultiProcessValue()


def forget_process(pid: int) -> None:
    """Drops the live gauges of an edge process that ended (the supervisor calls it)."""
    folder = os.environ.get(MULTIPROCESS_ENV)
    if folder:
        multiprocess.mark_process_dead(pid, folder)


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


class ConcurrencyStats(Protocol):
    """What the metrics read of :class:`edge.concurrency.ConcurrencyLimiter`."""

    rejected: int

    def in_use(self, identity: str | None = None) -> int: ...


#: The API surfaces that stream (the ``surface`` label): OpenAI chat and completions, the Responses
#: API, Anthropic Messages, the native event stream.
SURFACES = ("openai", "responses", "anthropic", "native")


class EdgeMetrics:
    """The edge's counters, gauges and histograms, and their exposition (one per app)."""

    def __init__(self) -> None:
        self._folder = os.environ.get(MULTIPROCESS_ENV) or None
        self.multiprocess = self._folder is not None
        # Single process: the metrics are registered here. Several: each process writes its
        # files and a scrape reads every process's files (registering them too would count
        # this process twice).
        self._registry = CollectorRegistry(auto_describe=True)
        own = None if self._folder else self._registry
        self._requests = Counter(
            "sluice_edge_requests",
            "HTTP requests answered, by route and status (a stream counts when its headers go out)",
            ["route", "status"],
            registry=own,
        )
        self._time_to_first_token = Histogram(
            "sluice_edge_time_to_first_token_seconds",
            "seconds from a stream request's arrival to its first output chunk, by API surface",
            ["surface"],
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self._chunk_gap = Histogram(
            "sluice_edge_inter_chunk_gap_seconds",
            "seconds between consecutive output writes of one stream, by API surface",
            ["surface"],
            buckets=GAP_BUCKETS,
            registry=own,
        )
        self._in_flight = Gauge(
            "sluice_edge_streams_in_flight",
            "SSE responses being sent, by API surface",
            ["surface"],
            registry=own,
            multiprocess_mode="livesum",
        )
        self._disconnects = Counter(
            "sluice_edge_client_disconnects",
            "streams that ended before their last frame (the client went away, or shutdown cut them), "
            "by API surface",
            ["surface"],
            registry=own,
        )
        self._stream_errors = Counter(
            "sluice_edge_stream_errors",
            "error events sent mid-stream, by API surface, error type and code",
            ["surface", "type", "code"],
            registry=own,
        )
        self._worker_up = Gauge(
            "sluice_edge_worker_up",
            "1 when the worker answers its health check SERVING, else 0",
            ["address"],
            registry=own,
            multiprocess_mode="livemax",
        )
        self._outstanding = Gauge(
            "sluice_edge_worker_outstanding_requests",
            "calls this edge has open on the worker",
            ["address"],
            registry=own,
            multiprocess_mode="livesum",
        )
        self._slots_in_use = Gauge(
            "sluice_edge_concurrency_slots_in_use",
            "generation requests holding a per-key concurrency slot",
            registry=own,
            multiprocess_mode="livesum",
        )
        self._rejections = Counter(
            "sluice_edge_concurrency_rejections",
            "generation requests refused (429) by the per-key concurrency limit",
            registry=own,
        )
        self._rate_limited = Counter(
            "sluice_edge_rate_limited_requests",
            "requests refused (429 rate_limit_exceeded) by their API key's per-minute limit, by the limit "
            "spent: requests or tokens",
            ["limit"],
            registry=own,
        )
        self._migrations = Counter(
            "sluice_edge_stream_migrations",
            "worker calls that failed mid-stream with their worker (UNAVAILABLE), by outcome: resumed "
            "(moved to another worker), failed (no worker took the rest), limit_reached, not_resumable "
            "(n > 1, or a worker without resume)",
            ["outcome"],
            registry=own,
        )
        self._rejections_seen = 0
        self._addresses: set[str] = set()
        for surface in SURFACES:  # every surface's series exists from the start, at 0
            self._in_flight.labels(surface)
            self._disconnects.labels(surface)
        # The per-write histograms' children, looked up once per surface on first use:
        # ``labels()`` costs several µs, and a busy edge observes these on every output write.
        self._ttft_by_surface: dict[str, Histogram] = {}
        self._gap_by_surface: dict[str, Histogram] = {}
        for outcome in MIGRATION_OUTCOMES:
            self._migrations.labels(outcome)
        for limit in RATE_LIMITS:
            self._rate_limited.labels(limit)

    # ---------------------------------------------------------------- hooks

    async def after_request(self, response: Response) -> Response:
        """Quart hook: counts the answered request by route and status."""
        rule = request.url_rule
        route = rule.rule if rule is not None else UNMATCHED_ROUTE
        self._requests.labels(route, str(response.status_code)).inc()
        return response

    # ------------------------------------------------- streams (their pumps report)

    def stream_opened(self, surface: str) -> None:
        self._in_flight.labels(surface).inc()

    def stream_closed(self, surface: str, *, disconnected: bool) -> None:
        """A stream ended; ``disconnected``: before its last frame (the client went away)."""
        self._in_flight.labels(surface).dec()
        if disconnected:
            self._disconnects.labels(surface).inc()

    def first_output(self, surface: str, seconds: float) -> None:
        """A stream's first write carrying output, ``seconds`` after its request arrived."""
        child = self._ttft_by_surface.get(surface)
        if child is None:
            child = self._ttft_by_surface[surface] = self._time_to_first_token.labels(surface)
        child.observe(seconds)

    def output_gap(self, surface: str, seconds: float) -> None:
        """``seconds`` between two writes of one stream that carried output."""
        child = self._gap_by_surface.get(surface)
        if child is None:
            child = self._gap_by_surface[surface] = self._chunk_gap.labels(surface)
        child.observe(seconds)

    def stream_error(self, surface: str, kind: str, code: str) -> None:
        """A stream ended with an error event of this type and code."""
        self._stream_errors.labels(surface, kind, code).inc()

    def rate_limited(self, limit: str) -> None:
        """A request refused because its key spent its ``limit`` (``requests`` or ``tokens``) for
        the minute."""
        self._rate_limited.labels(limit).inc()

    def stream_migration(self, outcome: str) -> None:
        """A call's worker died mid-stream; ``outcome`` is one of :data:`MIGRATION_OUTCOMES`. Counted
        for streamed and non-streamed requests alike (the calls do not know their surface)."""
        self._migrations.labels(outcome).inc()

    # ------------------------------------------------------------ live values

    async def refresh(self, pool: HealthSource, concurrency: ConcurrencyStats | None = None) -> None:
        """Sets the live gauges from the pool's latest health checks (asks no worker) and the
        limiter's counts."""
        health = await pool.health()
        seen = set()
        for worker in health:
            seen.add(worker.address)
            self._worker_up.labels(worker.address).set(int(worker.serving))
            self._outstanding.labels(worker.address).set(worker.outstanding)
        for gone in self._addresses - seen:  # a worker DNS no longer lists
            self._worker_up.remove(gone)
            self._outstanding.remove(gone)
        self._addresses = seen
        if concurrency is not None:
            self._slots_in_use.set(concurrency.in_use())
            self._rejections.inc(concurrency.rejected - self._rejections_seen)
            self._rejections_seen = concurrency.rejected

    # ------------------------------------------------------------ exposition

    async def render(self, pool: HealthSource, concurrency: ConcurrencyStats | None = None) -> str:
        """The Prometheus text: every process's metrics (see the module), live values fresh."""
        await self.refresh(pool, concurrency)
        if self._folder is None:
            return prometheus_client.generate_latest(self._registry).decode()
        everyone = CollectorRegistry()
        multiprocess.MultiProcessCollector(everyone, path=self._folder)
        return prometheus_client.generate_latest(everyone).decode()
