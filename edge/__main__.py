"""``python -m edge`` / ``sluice-edge``: serve the edge with hypercorn; drain gracefully on SIGTERM.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
from collections.abc import Coroutine, Sequence
from types import FrameType
from typing import Any

from hypercorn.asyncio import serve
from hypercorn.config import Config

from edge import event_loop
from edge.access_log import AccessLogger
from edge.app import create_app
from edge.drain import Drain
from edge.metrics import forget_process, use_multiprocess_dir
from edge.settings import Settings
from edge.streaming.connections import ClientConnections
from sluice.logs import configure_logging
from sluice.ports import EXIT_PORT_TAKEN, PortUnavailableError, check_port_free, claim_port

log = logging.getLogger("sluice.edge")

# After the grace period, ended streams get this long to write their last frames; then the
# connections still open are aborted (hypercorn would otherwise wait forever for a client
# that does not read to take its unsent bytes).
FINAL_WRITE_S = 1.0
# hypercorn's own grace is ours plus this, so it never cancels a stream we are still ending.
FINAL_WRITE_MARGIN_S = FINAL_WRITE_S + 1.0


def hypercorn_config(settings: Settings, listen_fd: int | None = None) -> Config:
    """The hypercorn config for ``settings`` (bind address, shutdown grace).

    ``listen_fd``: an already bound socket's descriptor, which hypercorn then owns.
    """
    config = Config()
    host = (
        f"[{settings.host}]" if ":" in settings.host and not settings.host.startswith("[") else settings.host
    )
    config.bind = [f"fd://{listen_fd}" if listen_fd is not None else f"{host}:{settings.port}"]
    # More than one worker makes hypercorn bind with SO_REUSEPORT: every process of this edge
    # binds the same port itself. (hypercorn's own serve() runs one process either way.)
    config.workers = settings.process_count
    config.graceful_timeout = settings.graceful_timeout_s + FINAL_WRITE_MARGIN_S
    config.accesslog = logging.getLogger("sluice.edge.access")
    config.logger_class = AccessLogger  # the same lines, each field computed only when written
    config.errorlog = logging.getLogger("sluice.edge.server")
    return config


async def serve_edge(
    settings: Settings,
    stop: asyncio.Event,
    drain: asyncio.Event | None = None,
    *,
    listen_fd: int | None = None,
) -> None:
    """Serves until shut down, then ends the requests in flight as described in the module.

    ``drain`` set: start draining and keep the listener open for
    ``--drain-delay``; ``stop`` set: the same without (or without the rest of)
    the delay. Either way requests in flight get ``--graceful-timeout``.
    ``listen_fd``: the claimed listening socket (else hypercorn binds the port itself).
    """
    app = create_app(settings)
    state = app.sluice
    log.info(
        "sluice-edge serving %s/v1 (workers: %s; event loop: %s)",
        settings.base_url,
        ", ".join(settings.workers),
        event_loop.running_kind(),
    )
    close_listener = asyncio.Event()
    shutdown = asyncio.create_task(
        _shutdown_sequence(
            settings, state.drain, state.connections, stop, drain or asyncio.Event(), close_listener
        )
    )
    try:
        await serve(app, hypercorn_config(settings, listen_fd), shutdown_trigger=close_listener.wait)
    finally:
        shutdown.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await shutdown


async def _shutdown_sequence(
    settings: Settings,
    state: Drain,
    connections: ClientConnections,
    stop: asyncio.Event,
    drain: asyncio.Event,
    close_listener: asyncio.Event,
) -> None:
    """Waits for ``stop`` or ``drain``, then drains, closes the listener and ends what is left.

    Cancelled by :func:`serve_edge` when hypercorn returned (every connection closed).
    """
    await _first_of(stop.wait(), drain.wait())
    state.begin()
    if not stop.is_set() and settings.drain_delay_s > 0:
        log.info(
            "draining: /ready answers 503 and new requests are refused; the listener closes in %.1f s",
            settings.drain_delay_s,
        )
        await _first_of(stop.wait(), asyncio.sleep(settings.drain_delay_s))
    log.info(
        "closing the listener; %d request(s) in flight get %.1f s",
        state.in_flight,
        settings.graceful_timeout_s,
    )
    close_listener.set()
    await asyncio.sleep(settings.graceful_timeout_s)
    ended = state.end_streams()
    if ended:
        log.warning("grace period over: ended %d request(s) with server_shutting_down", ended)
    await asyncio.sleep(FINAL_WRITE_S)
    aborted = connections.abort_all()
    if aborted:
        log.warning("closed %d client connection(s) that did not take their last bytes", aborted)


async def _first_of(*waits: Coroutine[Any, Any, Any]) -> None:
    """Returns when the first of ``waits`` finishes; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run(settings: Settings, listen_fd: int | None) -> None:
    stop, drain = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        # The first signal drains; a second one skips the rest of the drain delay.
        (stop if drain.is_set() else drain).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await serve_edge(settings, stop, drain, listen_fd=listen_fd)
    log.info("sluice-edge stopped")


def supervise(settings: Settings, count: int) -> int:
    """Runs ``count`` edge processes until they all exit (see the module); returns the exit status."""
    with tempfile.TemporaryDirectory(prefix="sluice-edge-metrics-") as folder:
        use_multiprocess_dir(folder)
        context = multiprocessing.get_context("fork")  # nothing runs yet: no loop, no channels
        children = [
            context.Process(target=_serve_one, args=(settings,), name=f"sluice-edge-{i}")
            for i in range(count)
        ]
        for child in children:
            child.start()
        stopping = False

        def stop_all(signum: int, _frame: FrameType | None = None) -> None:
            nonlocal stopping
            stopping = True
            for child in children:
                if child.is_alive() and child.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signum)

        signal.signal(signal.SIGTERM, stop_all)
        signal.signal(signal.SIGINT, stop_all)
        log.info("sluice-edge: %d processes serving %s", count, settings.base_url)
        status = 0
        running = list(children)
        while running:
            ended = multiprocessing.connection.wait([child.sentinel for child in running])
            for child in [c for c in running if c.sentinel in ended]:
                child.join()
                running.remove(child)
                if child.pid is not None:
                    forget_process(child.pid)
                code = child.exitcode or 0
                status = status or code
                if code and not stopping:
                    log.error("edge process %s exited with %s; stopping the others", child.name, code)
                    stop_all(signal.SIGTERM)
        return status if status >= 0 else 1  # killed by a signal: -N


def _serve_one(settings: Settings) -> None:
    """One edge process of :func:`supervise` (a forked child)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # asyncio installs its own in _run
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    event_loop.run(_run(settings, None), settings.event_loop)  # binds the port itself (SO_REUSEPORT)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: parse settings (exit 2 with a message if invalid) and serve."""
    settings = Settings.from_args(argv)
    configure_logging(settings.log_level, settings.log_format)
    count = settings.process_count
    try:
        if count > 1:
            check_port_free(settings.host, settings.port, "--port")
        else:
            sock = claim_port(settings.host, settings.port, "--port")
    except PortUnavailableError as error:
        log.error("%s", error.message)
        sys.exit(EXIT_PORT_TAKEN)
    if count > 1:
        sys.exit(supervise(settings, count))
    # hypercorn owns the descriptor from here on (it closes it at shutdown).
    event_loop.run(_run(settings, sock.detach()), settings.event_loop)


if __name__ == "__main__":
    main()
