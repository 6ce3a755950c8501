"""The edge's Prometheus metrics: what callers experienced, gathered without touching the flow.

Three sources, none of which changes what a caller receives:

- ``before_request`` / ``after_request`` hooks (:meth:`EdgeMetrics.before_request`,
  :meth:`EdgeMetrics.after_request`): the request's start time, and one count
  per answered request by route and HTTP status (a stream counts as its 200
  when its headers go out; how it ended is in the stream metrics);
- :func:`observe_stream`, which wraps an SSE body and watches its byte frames:
  the first ``data:`` frame carrying output gives the time to first token
  (from the request's start), every later one the gap since the previous,
  ``event: error`` frames are counted by type and code, and a stream closed
  or cancelled before its end counts as a client disconnect; the in-flight
  gauge goes up when the body starts and down however it ends;
- worker health, asked of the pool at scrape time (``await pool.health()``).

On a named-event surface (Responses, Anthropic, native; :class:`~edge.sse.Framing`)
the output frames are the surface's delta events and the error frames its
``error`` events. Generation requests and stream outcomes are also counted per
surface (``surface`` label: ``openai``, ``responses``, ``anthropic``, ``native``).

Role chunks (``"delta":{"role":"assistant","content":""}``) are sent as soon
as a worker accepts the call, before any token, so they are not "first
tokens"; every other ``data:`` frame but ``[DONE]`` is (a completions
``echo`` of the prompt included).

Everything runs on the event loop, so plain counters need no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from typing import Protocol

from quart import current_app, g, request
from quart.wrappers import Response

from edge.sse import OPENAI_FRAMING, Framing
from sluice import prometheus
from sluice.prometheus import GAP_BUCKETS, LATENCY_BUCKETS, Histogram

log = logging.getLogger("sluice.edge.stream")

METRICS_KEY = "sluice.metrics"
_STARTED_ATTR = "sluice_request_started"
_DATA = b"data: "
_DONE = b"data: [DONE]"
_ERROR = b"event: error"
_ROLE_CHUNK = b'"delta":{"role":"assistant","content":""}'
# Requests that matched no route share one label, so random paths cannot grow the series.
UNMATCHED_ROUTE = "other"
# The API surface of each generation blueprint, for the `surface` label.
SURFACES = {
    "chat": "openai",
    "completions": "openai",
    "responses": "responses",
    "messages": "anthropic",
    "native": "native",
}


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
        self.surface_requests: Counter[tuple[str, str]] = Counter()  # (surface, status)
        self.surface_streams: Counter[tuple[str, str]] = Counter()  # (surface, outcome)

    # ---------------------------------------------------------------- hooks

    async def before_request(self) -> None:
        """Quart hook: stamps the request's start (the reference of time to first token)."""
        setattr(g, _STARTED_ATTR, time.monotonic())

    async def after_request(self, response: Response) -> Response:
        """Quart hook: counts the answered request by route and status."""
        rule = request.url_rule
        route = rule.rule if rule is not None else UNMATCHED_ROUTE
        self.requests[(route, str(response.status_code))] += 1
        surface = SURFACES.get(request.blueprint or "")
        if surface is not None:
            self.surface_requests[(surface, str(response.status_code))] += 1
        return response

    # -------------------------------------------------------------- streams

    async def watch(
        self,
        body: AsyncIterable[bytes],
        started_at: float,
        request_id: str,
        framing: Framing = OPENAI_FRAMING,
    ) -> AsyncGenerator[bytes, None]:
        """Yields ``body``'s frames unchanged while measuring them (see the module docstring).

        ``framing`` tells output and error frames apart on a named-event surface
        (:class:`~edge.sse.Framing`); each stream's outcome (``completed``,
        ``error``, ``client_disconnect``) is counted under its surface.

        However this generator ends, the in-flight gauge is restored and
        ``body`` is closed before it returns (so the body's own cleanup,
        cancelling the worker calls, has run).
        """
        self.streams_in_flight += 1
        last_output: float | None = None
        frames = 0
        outcome = "client disconnected"
        source = aiter(body)
        try:
            async for frame in source:
                name = framing.event_name(frame) if framing.named else None
                if name is not None:
                    if name in framing.output_events:
                        now = time.monotonic()
                        if last_output is None:
                            self.time_to_first_token.observe(now - started_at)
                        else:
                            self.chunk_gap.observe(now - last_output)
                        last_output = now
                        frames += 1
                    elif name == "error":
                        kind, code = _error_labels(frame)
                        self.stream_errors[(kind, code)] += 1
                        outcome = f"error {kind}/{code}"
                elif frame.startswith(_DATA):
                    if not frame.startswith(_DONE) and _ROLE_CHUNK not in frame:
                        now = time.monotonic()
                        if last_output is None:
                            self.time_to_first_token.observe(now - started_at)
                        else:
                            self.chunk_gap.observe(now - last_output)
                        last_output = now
                    frames += 1
                elif frame.startswith(_ERROR):
                    kind, code = _error_labels(frame)
                    self.stream_errors[(kind, code)] += 1
                    outcome = f"error {kind}/{code}"
                yield frame
            if not outcome.startswith("error"):
                outcome = "completed"
            self.surface_streams[(framing.surface, outcome.partition(" ")[0])] += 1
        except (asyncio.CancelledError, GeneratorExit):
            # Quart cancels the body (or closes it at a yield) when the client goes away.
            self.client_disconnects += 1
            self.surface_streams[(framing.surface, "client_disconnect")] += 1
            raise
        except Exception as error:
            self.stream_errors[("api_error", "unhandled_exception")] += 1
            outcome = f"failed ({error.__class__.__name__})"
            raise
        finally:
            self.streams_in_flight -= 1
            log.info("request %s: stream %s after %d data frames", request_id, outcome, frames)
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(RuntimeError):  # "already running": it was just cancelled
                    await aclose()

    # ----------------------------------------------------------- exposition

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
            "sluice_edge_surface_requests_total",
            "counter",
            "generation requests answered, by API surface (openai, responses, anthropic, native) and status",
            [({"surface": sf, "status": st}, n) for (sf, st), n in sorted(self.surface_requests.items())],
        )
        lines += prometheus.simple_family(
            "sluice_edge_surface_streams_total",
            "counter",
            "streams ended, by API surface and outcome (completed, error, client_disconnect)",
            [({"surface": sf, "outcome": o}, n) for (sf, o), n in sorted(self.surface_streams.items())],
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


def current_metrics() -> EdgeMetrics:
    """The app's :class:`EdgeMetrics` (inside an app context)."""
    metrics: EdgeMetrics = current_app.extensions[METRICS_KEY]
    return metrics


def observe_stream(
    body: AsyncIterable[bytes], request_id: str = "", framing: Framing = OPENAI_FRAMING
) -> AsyncGenerator[bytes, None]:
    """Wraps an SSE body for the app's metrics; call it inside the request (it reads the
    app and the request's start time now, the returned generator runs later)."""
    started_at = g.get(_STARTED_ATTR) or time.monotonic()
    return current_metrics().watch(body, started_at, request_id or g.get("request_id", ""), framing)


def _error_labels(frame: bytes) -> tuple[str, str]:
    """(type, code) of an ``event: error`` frame's payload; ``unknown`` where absent."""
    _, _, data = frame.partition(_DATA)
    try:
        error = json.loads(data).get("error") or {}
    except (ValueError, AttributeError):
        return "unknown", "unknown"
    if not isinstance(error, dict):
        return "unknown", "unknown"
    if not error:
        # A Responses `error` event carries its code at the top level.
        with contextlib.suppress(ValueError, AttributeError):
            payload = json.loads(data)
            return "error", str(payload.get("code") or "unknown")
    return str(error.get("type") or "unknown"), str(error.get("code") or "unknown")
