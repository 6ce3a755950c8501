"""``sluice serve``: one worker and one edge on this machine, for local use.

Notes: docs/shared.md."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from sluice.ports import EXIT_PORT_TAKEN, METRICS_PORT_OFFSET, PortUnavailableError, check_port_free

READY_TIMEOUT_S = 600.0  # a first start converts the default model (about 20 s on two cores)
STOP_TIMEOUT_S = 15.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: OpenAI-compatible model serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run one worker and one edge together")
    serve.add_argument("--model", help="model for the worker (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1", help="address the edge listens on")
    serve.add_argument("--port", type=int, default=8080, help="HTTP port of the edge")
    serve.add_argument("--worker-port", type=int, default=50051, help="gRPC port of the worker")
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="worker metrics port (default: --worker-port + 1000; 0 = off)",
    )
    return parser


def _wait_ready(url: str, children: Sequence[subprocess.Popen[bytes]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(child.poll() is not None for child in children):
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False


def _stop(children: Sequence[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def worker_command(port: int, metrics_port: int | None, *extra: str, host: str = "127.0.0.1") -> list[str]:
    """The command line of a local worker process (used here, by the tests and by the benchmarks).

    ``metrics_port`` None leaves the worker's default (its gRPC port + 1000).
    """
    metrics = [] if metrics_port is None else ["--metrics-port", str(metrics_port)]
    return [sys.executable, "-m", "worker", "--host", host, "--port", str(port), *metrics, *extra]


def edge_command(workers: Sequence[str], port: int, *extra: str, host: str = "127.0.0.1") -> list[str]:
    """The command line of a local edge process."""
    return [
        sys.executable,
        "-m",
        "edge",
        "--workers",
        ",".join(workers),
        "--host",
        host,
        "--port",
        str(port),
        *extra,
    ]


def _check_ports(args: argparse.Namespace) -> str | None:
    """None when every port ``serve`` needs is free, else the one line saying which is not."""
    metrics_port = args.worker_port + METRICS_PORT_OFFSET if args.metrics_port is None else args.metrics_port
    wanted = [(args.host, args.port, "--port"), ("127.0.0.1", args.worker_port, "--worker-port")]
    if metrics_port:
        wanted.append(("127.0.0.1", metrics_port, "--metrics-port"))
    for i, (_, port, flag) in enumerate(wanted):
        for _, other_port, other_flag in wanted[:i]:
            if port == other_port:
                return f"{flag} {port} is also {other_flag}; give each its own port"
    try:
        for host, port, flag in wanted:
            check_port_free(host, port, flag)
    except PortUnavailableError as error:
        return error.message
    return None


def serve(args: argparse.Namespace) -> int:
    taken = _check_ports(args)
    if taken is not None:
        print(f"sluice: {taken}", file=sys.stderr)
        return EXIT_PORT_TAKEN
    worker_cmd = worker_command(args.worker_port, args.metrics_port, "--grace-period", "5")
    if args.model:
        worker_cmd += ["--model", args.model]
    # No load balancer watches a local edge's readiness: Ctrl-C need not wait out a drain delay.
    edge_cmd = edge_command(
        [f"127.0.0.1:{args.worker_port}"], args.port, "--drain-delay", "0", host=args.host
    )
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # Children ignore the terminal's Ctrl-C (own process group); we stop them in order.
    worker = subprocess.Popen(worker_cmd, start_new_session=True)
    edge = subprocess.Popen(edge_cmd, start_new_session=True)
    children = [edge, worker]
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    base = f"http://{host}:{args.port}"
    try:
        print(
            f"sluice: starting worker (:{args.worker_port}) and edge (:{args.port}); "
            "the first start converts the model, about 20 s",
            flush=True,
        )
        if not _wait_ready(f"{base}/ready", children, READY_TIMEOUT_S):
            if not stopping:
                print("sluice: the stack did not become ready; see the logs above", file=sys.stderr)
            return 0 if stopping else 1
        print(f"sluice: serving at {base}/v1  (Ctrl-C stops)", flush=True)
        while not stopping:
            if any(child.poll() is not None for child in children):
                print("sluice: a process exited; stopping", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        print("sluice: stopping", flush=True)
        _stop(children)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
