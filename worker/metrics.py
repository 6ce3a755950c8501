"""Prometheus text exposition of the engine's state, on a small HTTP endpoint.

``GET /metrics`` answers with the current gauges and counters (503 while the
model loads); anything else is 404. It uses asyncio streams only, so the worker
needs no web framework. The endpoint serves on a socket the worker claimed at
start (:func:`sluice.ports.claim_port`), before the model loads.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from sluice import prometheus
from worker.engine import EngineStats

log = logging.getLogger(__name__)


def render(stats: EngineStats, model_id: str) -> str:
    """The exposition text for one engine snapshot; every sample carries ``model``."""
    c = stats.counters
    label = {"model": model_id}
    rows = [
        ("sluice_worker_queue_depth", "gauge", "requests waiting for a batch slot", stats.waiting_requests),
        ("sluice_worker_running_requests", "gauge", "requests in the running batch", stats.running_requests),
        (
            "sluice_worker_running_sequences",
            "gauge",
            "sequences in the running batch",
            stats.running_sequences,
        ),
        ("sluice_worker_live_caches", "gauge", "sequences holding a KV cache", stats.live_caches),
        ("sluice_worker_kv_cache_tokens", "gauge", "tokens held in the KV cache", stats.cache_tokens),
        ("sluice_worker_kv_cache_bytes", "gauge", "bytes allocated for the KV cache", stats.cache_bytes),
        (
            "sluice_worker_reserved_tokens",
            "gauge",
            "prompt + max_tokens reserved by running sequences",
            stats.reserved_tokens,
        ),
        ("sluice_worker_requests_submitted_total", "counter", "requests admitted", c.requests_submitted),
        ("sluice_worker_requests_finished_total", "counter", "requests finished", c.requests_finished),
        (
            "sluice_worker_requests_cancelled_total",
            "counter",
            "requests cancelled by callers",
            c.requests_cancelled,
        ),
        ("sluice_worker_requests_failed_total", "counter", "requests failed by the model", c.requests_failed),
        (
            "sluice_worker_generated_tokens_total",
            "counter",
            "completion tokens generated",
            c.generated_tokens,
        ),
        ("sluice_worker_prompt_tokens_total", "counter", "prompt tokens admitted", c.prompt_tokens),
        (
            "sluice_worker_prefix_cache_hit_tokens_total",
            "counter",
            "prompt tokens whose KV came from the prefix cache",
            c.prefix_cache_hit_tokens,
        ),
        ("sluice_worker_steps_total", "counter", "engine steps run", c.steps),
    ]
    lines: list[str] = []
    for name, kind, help_text, value in rows:
        lines += prometheus.simple_family(name, kind, help_text, [(label, value)])
    lines += prometheus.histogram_family(
        "sluice_worker_time_to_first_token_seconds",
        "seconds from arrival to a choice's first token",
        c.time_to_first_token,
        label,
    )
    return prometheus.render(lines)


async def serve_metrics(sock: socket.socket, text: Callable[[], str | None]) -> asyncio.Server:
    """Serves ``GET /metrics`` on the listening ``sock``; ``text()`` None (no model yet) is a 503."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request_line.decode("latin-1").split()
            if len(parts) < 2 or parts[0] != "GET" or parts[1].split("?")[0] != "/metrics":
                status, body, ctype = "404 Not Found", b"not found\n", "text/plain"
            elif (exposition := text()) is None:
                status, body, ctype = "503 Service Unavailable", b"the model is loading\n", "text/plain"
            else:
                status, body, ctype = "200 OK", exposition.encode(), prometheus.CONTENT_TYPE
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, sock=sock)
