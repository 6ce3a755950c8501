"""deploy/healthcheck.py (``sluice-healthcheck`` in the images) against real servers.

A real gRPC server with the standard health service stands in for a worker, and a real
HTTP server for an edge; the probe runs as a separate process, as Docker runs it.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.deploy.manifests import DEPLOY

SCRIPT = DEPLOY / "healthcheck.py"


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.fixture
def grpc_health() -> Iterator[tuple[int, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(None)


@pytest.fixture
def http_server() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response({"/health": 200, "/ready": 503}.get(self.path, 404))
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_grpc_serving_is_healthy_and_not_serving_is_not(grpc_health):
    port, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert probe("grpc", f"127.0.0.1:{port}").returncode == 0
    # While the model loads and while draining, the worker answers NOT_SERVING.
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    result = probe("grpc", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert "NOT_SERVING" in result.stderr


def test_grpc_default_target_follows_the_worker_port_setting(grpc_health):
    port, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert probe("grpc", env={"SLUICE_WORKER_PORT": str(port)}).returncode == 0


def test_grpc_nothing_listening_is_unhealthy_with_a_reason():
    port = _free_port()
    result = probe("grpc", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert f"127.0.0.1:{port}" in result.stderr and "UNAVAILABLE" in result.stderr


def test_http_checks_the_status_code(http_server):
    assert probe("http", f"http://127.0.0.1:{http_server}/health").returncode == 0
    result = probe("http", f"http://127.0.0.1:{http_server}/ready")
    assert result.returncode == 1 and "HTTP 503" in result.stderr
    # The default is /health on the edge's configured port.
    assert probe("http", env={"SLUICE_EDGE_PORT": str(http_server)}).returncode == 0


def test_http_nothing_listening_is_unhealthy():
    result = probe("http", f"http://127.0.0.1:{_free_port()}/health")
    assert result.returncode == 1 and result.stderr.startswith("unhealthy:")


def test_bad_usage_is_an_argparse_error():
    result = probe("tcp")
    assert result.returncode == 2 and "invalid choice" in result.stderr
