"""``python -m edge`` / ``sluice-edge``: serve the edge with hypercorn until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence

from hypercorn.asyncio import serve
from hypercorn.config import Config

from edge.app import create_app
from edge.settings import Settings

log = logging.getLogger("sluice.edge")


def hypercorn_config(settings: Settings) -> Config:
    """The hypercorn config for ``settings`` (bind address, shutdown grace)."""
    config = Config()
    host = (
        f"[{settings.host}]" if ":" in settings.host and not settings.host.startswith("[") else settings.host
    )
    config.bind = [f"{host}:{settings.port}"]
    config.graceful_timeout = settings.graceful_timeout_s
    config.accesslog = logging.getLogger("sluice.edge.access")
    config.errorlog = logging.getLogger("sluice.edge.server")
    return config


async def serve_edge(settings: Settings, stop: asyncio.Event) -> None:
    """Serves until ``stop`` is set, then lets open streams finish (up to the grace period)."""
    app = create_app(settings)
    log.info("sluice-edge serving %s/v1 (workers: %s)", settings.base_url, ", ".join(settings.workers))
    await serve(app, hypercorn_config(settings), shutdown_trigger=stop.wait)


async def _run(settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve_edge(settings, stop)
    log.info("sluice-edge stopped")


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: parse settings (exit 2 with a message if invalid) and serve."""
    settings = Settings.from_args(argv)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(_run(settings))


if __name__ == "__main__":
    main()
