"""``python -m worker`` / ``sluice-worker``: serve one model over gRPC.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Sequence

from sluice.compiled import StaleBuild, check_fresh
from sluice.logs import configure_logging
from sluice.ports import (
    EXIT_PORT_TAKEN,
    METRICS_PORT_OFFSET,
    PortUnavailableError,
    check_port_free,
    claim_port,
)
from worker.config import WorkerConfig, parse_config

log = logging.getLogger("sluice.worker")


def claim_ports(config: WorkerConfig) -> socket.socket | None:
    """Checks the gRPC port is free and claims the metrics port (its socket, None when off).

    Raises :class:`PortUnavailableError` naming ``--port`` or ``--metrics-port``. The gRPC
    port is only checked here: the gRPC server binds it itself as soon as it is imported.
    """
    check_port_free(config.host, config.port, "--port")
    if not config.resolved_metrics_port:
        return None
    try:
        return claim_port(config.host, config.resolved_metrics_port, "--metrics-port")
    except PortUnavailableError as error:
        if config.metrics_port is not None:
            raise
        # The user never typed this port: say where it came from.
        raise PortUnavailableError(
            f"{error.message} (unset, --metrics-port is --port + {METRICS_PORT_OFFSET})"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, config.log_format, worker_id=config.resolved_worker_id)
    try:
        check_fresh()
    except StaleBuild as error:
        log.error("%s", error)
        return 1
    if config.node_rank > 0:  # a tensor-parallel node other than rank 0's: its ranks, no ports
        from worker.parallel.ranks import serve_node

        return serve_node(config)
    try:
        metrics_socket = claim_ports(config)
    except PortUnavailableError as error:
        log.error("%s", error.message)
        return EXIT_PORT_TAKEN
    # Imported only now: torch and transformers take seconds, a port conflict must not.
    from worker.server import run

    return asyncio.run(run(config, metrics_socket=metrics_socket))


if __name__ == "__main__":
    sys.exit(main())
