"""The edge's wiring in one place: the application state and the per-request state, both typed.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quart import Quart, current_app, g

if TYPE_CHECKING:
    from edge.background import BackgroundTasks
    from edge.concurrency import ConcurrencyLimiter
    from edge.drain import Drain
    from edge.metrics import EdgeMetrics
    from edge.rate_limits import RateLimiter
    from edge.request_log import RequestLogger, RequestRecord
    from edge.settings import Settings
    from edge.store.opening import StoreHandle
    from edge.streaming.connections import ClientConnections
    from edge.workers.pool import WorkerPool

_REQUEST_ATTR = "sluice_request"


@dataclass
class EdgeState:
    """Everything the edge's handlers share within one process (one event loop)."""

    settings: Settings
    pool: WorkerPool
    metrics: EdgeMetrics
    drain: Drain
    limiter: ConcurrencyLimiter
    connections: ClientConnections
    store: StoreHandle
    background: BackgroundTasks
    request_log: RequestLogger | None = None
    rate_limits: RateLimiter | None = None


class EdgeApp(Quart):
    """The Quart app of the edge: a Quart app with its :class:`EdgeState`."""

    sluice: EdgeState


def app_state(app: Quart) -> EdgeState:
    """The state of ``app`` (an :class:`EdgeApp` made by ``create_app``)."""
    if not isinstance(app, EdgeApp):
        raise TypeError(f"not an edge app: {app!r}")
    return app.sluice


def current_state() -> EdgeState:
    """The state of the app serving the current request or app context."""
    return app_state(current_app._get_current_object())  # type: ignore[attr-defined]


@dataclass
class RequestState:
    """One request's id (echoed in ``X-Request-ID``, sent to the worker), its start time
    (``time.monotonic()``, the reference of the time to first token) and its log line's record."""

    request_id: str
    started_at: float = field(default_factory=time.monotonic)
    log: RequestRecord | None = None  # with --log-requests, for an API request


def begin_request(request_id: str) -> RequestState:
    """Makes the current request's state (the first ``before_request`` hook calls it)."""
    state = RequestState(request_id)
    setattr(g, _REQUEST_ATTR, state)
    return state


def current_request() -> RequestState | None:
    """The current request's state; ``None`` before :func:`begin_request` ran (an error raised
    by Quart before any hook)."""
    state: RequestState | None = g.get(_REQUEST_ATTR)
    return state
