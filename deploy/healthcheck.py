#!/usr/bin/env python3
"""Container health probe, installed in both images as ``sluice-healthcheck``.

    sluice-healthcheck grpc [HOST:PORT]   worker: grpc.health.v1 Check("") answers SERVING
    sluice-healthcheck http [URL]         edge: GET answers 200

Without an address it probes this container's own service on the port its
settings give (``SLUICE_WORKER_PORT``, default 50051; ``SLUICE_EDGE_PORT``,
default 8080, path ``/health``), so a Docker HEALTHCHECK or a Compose
healthcheck follows a changed port without being edited. Exit status 0 when
healthy, 1 otherwise, with one line on stderr saying why (Docker keeps it in
``docker inspect``). Kubernetes uses its native gRPC and HTTP probes instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

TIMEOUT_S = 4.0


def default_grpc_target() -> str:
    """127.0.0.1 and the worker's configured gRPC port."""
    return f"127.0.0.1:{os.environ.get('SLUICE_WORKER_PORT') or 50051}"


def default_http_url() -> str:
    """The edge's liveness endpoint on its configured port."""
    return f"http://127.0.0.1:{os.environ.get('SLUICE_EDGE_PORT') or 8080}/health"


def check_grpc(target: str, timeout: float = TIMEOUT_S) -> str | None:
    """None when the server's overall health is SERVING, else the reason."""
    # Imported here so that the http check works without grpc installed.
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError as error:
            return f"{target}: {error.code().name}: {error.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def check_http(url: str, timeout: float = TIMEOUT_S) -> str | None:
    """None when ``GET url`` answers 200, else the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        return f"{url}: {reason}"
    return None if status == 200 else f"{url}: HTTP {status}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sluice-healthcheck", description="Health probe for Sluice containers."
    )
    parser.add_argument("kind", choices=("grpc", "http"), help="grpc for a worker, http for an edge")
    parser.add_argument("target", nargs="?", help="HOST:PORT (grpc) or URL (http); default: this container")
    args = parser.parse_args(argv)
    if args.kind == "grpc":
        problem = check_grpc(args.target or default_grpc_target())
    else:
        problem = check_http(args.target or default_http_url())
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
