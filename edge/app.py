"""The Quart application: :func:`create_app` wires settings, worker pool, auth, routes and errors.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import AsyncGenerator

from quart import request
from quart.wrappers import Response
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from edge.auth import ApiKeyCheck
from edge.background import BackgroundTasks
from edge.concurrency import ConcurrencyLimiter, ReleaseSlots
from edge.cors import Cors
from edge.drain import Drain
from edge.errors import (
    GENERIC_INTERNAL_MESSAGE,
    EdgeError,
    InternalError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
)
from edge.http import (
    assign_request_id,
    current_request_id,
    error_response,
    refuse_unknown_fields,
    use_request_limits,
)
from edge.logs import begin_request_log, bind_request_id, end_request_log, log_record, log_request
from edge.metrics import EdgeMetrics
from edge.rate_limit_redis import RedisCounters
from edge.rate_limits import CounterStore, LocalCounters, RateLimiter
from edge.request_log import RequestLogger
from edge.routes import register_routes
from edge.settings import Settings, api_key_tenants
from edge.state import EdgeApp, EdgeState
from edge.store.opening import StoreHandle, purge
from edge.streaming.connections import ClientConnections
from edge.surfaces.batches.runner import BatchRunner
from edge.surfaces.responses.resume import Resumer
from edge.tracing import SERVICE_NAME as TRACE_SERVICE_NAME
from edge.tracing import EdgeTracing
from edge.workers.pool import WorkerPool
from sluice.client import WorkerClient
from sluice.heap import freeze_startup_heap
from sluice.tracing import open_tracer

log = logging.getLogger("sluice.edge")
# Seconds between two purges of the state store (at most --state-ttl).
PURGE_INTERVAL_S = 300.0


def create_app(settings: Settings) -> EdgeApp:
    """Builds the edge app. Channels open in ``before_serving`` (or on first use) and
    close in ``after_serving``; nothing connects at construction time."""
    app = EdgeApp("edge")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    pool = WorkerPool(
        settings.workers,
        connect_timeout_s=settings.worker_connect_timeout_s,
        health_timeout_s=settings.health_timeout_s,
        health_interval_s=settings.health_interval_s,
        dns_name=settings.worker_dns,
        dns_refresh_interval_s=settings.dns_refresh_interval_s,
        routing=settings.routing,
        multiplexed=settings.multiplexed_streams,
        client_factory=functools.partial(WorkerClient, streams_connections=settings.worker_connections),
    )
    metrics = EdgeMetrics()
    limiter = ConcurrencyLimiter(settings.max_concurrent_per_key)
    rate_limits = _rate_limiter(settings, metrics)
    # Outermost ASGI layer: a client that stops reading is disconnected after --write-timeout.
    connections = ClientConnections(app.asgi_app, settings.write_timeout_s)
    app.sluice = EdgeState(
        settings=settings,
        pool=pool,
        metrics=metrics,
        drain=Drain(),
        limiter=limiter,
        connections=connections,
        store=StoreHandle(settings.state_dir, settings.state_url, settings.retention),
        background=BackgroundTasks(),
        request_log=RequestLogger(settings.log_request_text) if settings.log_requests else None,
        rate_limits=rate_limits,
    )

    @app.before_serving
    async def open_pool() -> None:
        # Channels, DNS discovery and the health-check loop start here; close() stops them.
        app.sluice.pool.open()
        await app.sluice.store.get()  # migrated and purged before the first request
        # Each in a context of its own, outside this hook's app context: a request they make
        # (a batch line, a re-run response) then gets an app context, and so a `g`, of its own,
        # where inside this one all of them would share one (ids, API keys, rate-limit tickets).
        app.sluice.background.spawn("batch runner", BatchRunner(app).run(), contextvars.Context())
        app.sluice.background.spawn("response resumer", Resumer(app).run(), contextvars.Context())
        freeze_startup_heap(log, "edge")
        dns = [f"DNS {settings.worker_dns}"] if settings.worker_dns else []
        log.info("edge ready for workers %s", ", ".join([*settings.workers, *dns]))

    @app.after_serving
    async def close_pool() -> None:
        await app.sluice.background.close()
        await app.sluice.store.close()
        await app.sluice.pool.close()
        if rate_limits is not None:
            await rate_limits.store.close()

    @app.while_serving
    async def purge_store() -> AsyncGenerator[None, None]:
        task = asyncio.create_task(_purge_loop(app.sluice))
        yield
        task.cancel()

    if metrics.multiprocess:
        # A scrape reaches one process: the others keep their live gauges fresh themselves.
        @app.while_serving
        async def refresh_metrics() -> AsyncGenerator[None, None]:
            task = asyncio.create_task(_refresh_loop(app.sluice))
            yield
            task.cancel()

    app.before_request(assign_request_id)
    app.before_request(bind_request_id)
    tracing = _tracing(settings)
    if tracing is not None:
        app.before_request(tracing.begin)
        app.after_request(tracing.after)

        @app.after_serving
        async def close_tracer() -> None:
            await asyncio.to_thread(tracing.tracer.close)  # the spans still batched

    if settings.log_requests:
        app.before_request(begin_request_log)
    app.before_request(use_request_limits)
    cors = Cors(settings.allowed_origins)
    if cors.enabled:
        # Before the API-key check: a browser's preflight never carries the key.
        app.before_request(cors.preflight)
        app.after_request(cors.mark)
    if settings.strict_fields:
        app.before_request(refuse_unknown_fields)
    api_keys = ApiKeyCheck(settings.api_keys, api_key_tenants(settings.api_keys_file))
    if api_keys.enabled:
        app.before_request(api_keys.before_request)
    if rate_limits is not None:
        app.before_request(rate_limits.identify)
    if limiter.enabled:
        app.before_request(limiter.before_request)
    if rate_limits is not None:
        app.before_request(rate_limits.check)
        app.after_request(rate_limits.after_request)
    app.after_request(metrics.after_request)
    app.after_request(log_request)
    if settings.log_requests:
        app.after_request(end_request_log)

    @app.after_request
    async def add_request_id(response: Response) -> Response:
        response.headers.setdefault("X-Request-ID", current_request_id())
        return response

    @app.errorhandler(EdgeError)
    async def handle_edge_error(error: EdgeError) -> Response:
        record = log_record()
        if record is not None:
            record.error = str(error.code or error.type)
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def handle_http_exception(error: HTTPException) -> Response:
        response = error_response(_from_http_exception(error))
        if isinstance(error, MethodNotAllowed) and error.valid_methods:
            response.headers["Allow"] = ", ".join(error.valid_methods)
        return response

    @app.errorhandler(Exception)
    async def handle_unexpected(error: Exception) -> Response:
        log.exception("request %s failed", current_request_id(), exc_info=error)
        return error_response(InternalError(GENERIC_INTERNAL_MESSAGE))

    register_routes(app)
    inner = ReleaseSlots(app.asgi_app) if limiter.enabled else app.asgi_app
    connections.app = inner
    app.asgi_app = connections  # type: ignore[method-assign]
    return app


def _tracing(settings: Settings) -> EdgeTracing | None:
    """The hooks of --otlp-traces-endpoint (None, and opentelemetry not imported, without it)."""
    tracer = open_tracer(TRACE_SERVICE_NAME, settings.otlp_traces_endpoint)
    return EdgeTracing(tracer) if tracer is not None else None


def _rate_limiter(settings: Settings, metrics: EdgeMetrics) -> RateLimiter | None:
    """The per-key rate limits of --api-keys-file, counted here or in --rate-limit-redis-url's Redis;
    None when no key has limits."""
    positions = {key: index for index, key in enumerate(settings.api_keys)}
    limits = {positions[key]: (key, lim) for key, lim in settings.key_limits if key in positions}
    if not limits:
        return None
    url = settings.rate_limit_redis_url
    store: CounterStore = RedisCounters(url) if url else LocalCounters()
    return RateLimiter(limits, store, metrics)


async def _refresh_loop(state: EdgeState) -> None:
    while True:
        try:
            await state.metrics.refresh(state.pool, state.limiter)
        except Exception:  # a metrics hiccup must not end the loop
            log.exception("refreshing the live metrics failed")
        await asyncio.sleep(state.settings.health_interval_s)


async def _purge_loop(state: EdgeState) -> None:
    """Deletes expired responses (and the oldest over the size limit) every few minutes."""
    interval = min(PURGE_INTERVAL_S, state.settings.state_ttl_s)
    while True:
        await asyncio.sleep(interval)
        try:
            await purge(await state.store.get())
        except Exception:  # a database hiccup must not end the loop
            log.exception("purging the state store failed")


def _from_http_exception(error: HTTPException) -> EdgeError:
    """werkzeug's routing and body errors, in the OpenAI shape."""
    status = error.code or 500
    if status == 404:
        return NotFoundError(f"Invalid URL ({request.method} {request.path}).")
    if status == 405:
        return MethodNotAllowedError(f"Method {request.method} is not allowed on {request.path}.")
    if status == 413:
        return PayloadTooLargeError(f"The request body is larger than {request.max_content_length} bytes.")
    if 400 <= status < 500:
        mapped: EdgeError = InvalidRequestError(error.description or error.name)
    else:
        mapped = InternalError(GENERIC_INTERNAL_MESSAGE)
    mapped.http_status = status
    return mapped
