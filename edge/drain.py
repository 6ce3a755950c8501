"""The edge's shutdown state: draining (refuse new work) and ending the streams still open.

Order on SIGTERM (driven by :mod:`edge.__main__`):

1. :meth:`Drain.begin`: ``/ready`` answers 503 and new generation requests get
   503 ``server_shutting_down`` with ``Retry-After``; the listener stays open
   for ``--drain-delay`` seconds so load balancers see readiness flip first;
2. the listener closes; requests in flight go on for ``--graceful-timeout``;
3. :meth:`Drain.end_streams`: every request still in flight ends with an
   ``event: error`` (``server_shutting_down``) and ``data: [DONE]`` (a
   non-streaming one with a 503), so no client sees a connection cut mid-JSON;
4. hypercorn closes what is left and the process exits 0.

Requests take part through :meth:`Drain.track`, which registers their
:class:`~edge.deadlines.EventGuard` for step 3.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from quart import Quart, current_app

from edge.deadlines import EventGuard
from edge.errors import ServerShuttingDownError

DRAIN_KEY = "sluice.drain"
# Retry-After on answers refused while draining: another replica can take the request now.
RETRY_AFTER_S = 1.0


def shutting_down_error() -> ServerShuttingDownError:
    """The 503 a new request gets while the edge drains."""
    return ServerShuttingDownError(
        "The server is shutting down; please retry (another replica will take the request).",
        retry_after=RETRY_AFTER_S,
    )


class Drain:
    """Shutdown state of one edge process; use inside its event loop."""

    def __init__(self) -> None:
        self._draining = False
        self._ended = False
        self._guards: set[EventGuard] = set()

    @property
    def draining(self) -> bool:
        """True from :meth:`begin` on: refuse new generation requests, report not ready."""
        return self._draining

    @property
    def in_flight(self) -> int:
        """Requests currently tracked (streams and non-streaming answers being collected)."""
        return len(self._guards)

    def begin(self) -> None:
        """Starts draining; idempotent."""
        self._draining = True

    def end_streams(self) -> int:
        """Ends every tracked request with ``server_shutting_down`` (and any tracked later, at
        once); returns how many were open."""
        self._draining = self._ended = True
        guards = list(self._guards)
        for guard in guards:
            guard.stop(_grace_over_error())
        return len(guards)

    @contextlib.contextmanager
    def track(self, guard: EventGuard) -> Iterator[EventGuard]:
        """Registers ``guard`` for :meth:`end_streams` while the block runs."""
        if self._ended:
            guard.stop(_grace_over_error())
        self._guards.add(guard)
        try:
            yield guard
        finally:
            self._guards.discard(guard)


def _grace_over_error() -> ServerShuttingDownError:
    return ServerShuttingDownError(
        "The server is shutting down and the request's grace period ended; please retry.",
        retry_after=RETRY_AFTER_S,
    )


def install(app: Quart) -> Drain:
    """Creates the app's :class:`Drain` (once, in ``create_app``)."""
    drain = Drain()
    app.extensions[DRAIN_KEY] = drain
    return drain


def app_drain(app: Quart) -> Drain:
    """The :class:`Drain` of ``app``."""
    drain: Drain = app.extensions[DRAIN_KEY]
    return drain


def current_drain() -> Drain:
    """The :class:`Drain` of the app serving the current request."""
    return app_drain(current_app)
