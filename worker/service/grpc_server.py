"""A serving process's gRPC server: the worker service behind its drain, health and reflection,
with the server's channel settings; shared by every serving process (``--api-server-count``).

Design notes: docs/worker.md ("Serving processes").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sluice.client import MAX_MESSAGE_BYTES
from sluice.v1 import worker_pb2
from worker.service.drain import DrainingWorker
from worker.service.servicer import WorkerService
from worker.service.wire_decoding import add_worker_service

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# Server channel settings; the client side is sluice.client.CHANNEL_OPTIONS. Why:
# - message sizes match the client's (a whole prompt fits in one request);
# - keepalive enforcement: clients ping every 20 s, with or without calls. The
#   server accepts pings down to every 10 s and with no call open; stricter
#   values would make it answer a well-behaved client with GOAWAY
#   "too_many_pings" and drop its connection;
# - the server's own pings (every 60 s, 20 s to answer) close connections of
#   clients that vanished, freeing their calls;
# - max connection age: every connection is closed (GOAWAY) after about 5
#   minutes (gRPC adds +-10% jitter), so clients that reach workers through a
#   DNS name re-resolve and spread over new replicas. The grace lets calls
#   already running on the old connection finish: it is longer than the edge's
#   default request deadline (600 s), so age alone never cuts a generation.
#   New calls go to a new connection at once (and, with several serving
#   processes, may reach another of them);
# - no SO_REUSEPORT (gRPC's default on Linux) unless several serving processes
#   share the port: with it, a second worker started on a taken port binds it
#   without an error and the kernel splits the callers' connections between the
#   two processes (the port is checked free before the first one binds).
MAX_CONNECTION_AGE_MS = 5 * 60_000
MAX_CONNECTION_AGE_GRACE_MS = 11 * 60_000
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
    ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
    ("grpc.so_reuseport", 0),
]
# Calls cut at the end of the grace period get this long to send their status.
_CUT_WAIT_S = 2.0
# The exit status after the engine could not go on (its device failed, or its state could no longer
# be trusted: docs/worker.md, "Failure isolation"): the orchestrator restarts the worker.
EXIT_ENGINE_FAILED = 3


class GrpcServer:
    """``service`` behind a drain (:class:`DrainingWorker`), with gRPC health and reflection.
    ``share_port``: SO_REUSEPORT, for serving processes that listen on one port."""

    def __init__(self, service: WorkerService, *, share_port: bool = False):
        self.served = DrainingWorker(service)
        self._health: Any = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        options = [
            (name, int(share_port) if name == "grpc.so_reuseport" else v) for name, v in SERVER_OPTIONS
        ]
        self.server = grpc.aio.server(options=options)
        add_worker_service(self.served, self.server)  # undecodable bytes: INVALID_ARGUMENT, not UNKNOWN
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )

    async def set_serving(self, serving: bool) -> None:
        """Health SERVING or NOT_SERVING, for the whole server and the Worker service."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            result = self._health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def drain(self, grace_period: float) -> None:
        """Health NOT_SERVING, refuse new calls, give in-flight calls the grace, then cut them."""
        await self.set_serving(False)
        served = self.served
        served.start_drain()
        log.info("draining: refusing new calls, %g s grace for %d in-flight", grace_period, served.in_flight)
        if await served.wait_idle(grace_period):
            log.info("drained: every in-flight call finished")
            return
        log.warning("grace period over: ending %d in-flight calls with UNAVAILABLE", served.cut())
        if not await served.wait_idle(_CUT_WAIT_S):
            log.warning("%d calls did not end after the cut; the server stop cancels them", served.in_flight)
