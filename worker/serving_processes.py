"""More serving processes (``--api-server-count``, vLLM's name): each its own gRPC server on the one
port (SO_REUSEPORT), prompts and output processing, fed by the engine process over its own pipe;
started by the first serving process, and the worker lives, drains and fails as one.

Design notes: docs/worker.md ("Serving processes").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any

from sluice.heap import freeze_startup_heap
from sluice.logs import configure_logging
from sluice.ports import EXIT_PORT_TAKEN
from sluice.tracing import open_tracer
from worker.config import WorkerConfig
from worker.engine.process import EngineClient, join_engine_process
from worker.engine.process_messages import ModelFacts
from worker.model.load_progress import LoadProgress
from worker.model.loader import ModelLoadError
from worker.output.processor import TextRules
from worker.service.grpc_server import EXIT_ENGINE_FAILED, GrpcServer
from worker.service.servicer import ServingModel, WorkerService
from worker.service.tracing import SERVICE_NAME as TRACE_SERVICE_NAME

log = logging.getLogger(__name__)

# How long a serving process may take to start (its imports, the tokenizer, the grammar tables).
START_WAIT_S = 120.0
# Past the grace period, how long a stopping serving process may take before it is killed.
STOP_MARGIN_S = 10.0

# What builds a serving process's model from its engine client (worker.server.serving_of_engine).
BuildServing = Callable[[WorkerConfig, EngineClient, ModelFacts], ServingModel]


class ServingProcessError(Exception):
    """A serving process could not start."""


class ServingProcesses:
    """The serving processes beyond the first, started by it (:meth:`start`), watched
    (:meth:`watch`) and stopped with it (:meth:`stop`)."""

    def __init__(self, processes: list[BaseProcess]):
        self._processes = processes
        self._stopping = False

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes if process.pid is not None]

    @classmethod
    def start(cls, config: WorkerConfig, client: EngineClient, build: BuildServing) -> ServingProcesses:
        """Starts ``config.api_server_count - 1`` serving processes, each with a pipe whose other end
        ``client`` hands the engine process, and waits until each serves (blocking: run in a thread);
        raises :class:`ServingProcessError` (the others stopped) when one does not."""
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe() for _ in range(config.api_server_count - 1)]
        client.attach([engine_end for _, engine_end in pipes])
        started: list[tuple[Any, Event]] = []
        for index, (ours, engine_end) in enumerate(pipes, start=1):
            engine_end.close()  # the engine process holds its own copy now
            up = context.Event()
            process = context.Process(
                target=serving_main,
                args=(index, ours, config, client.pid, up, build),
                name=f"sluice-serving-{index}",
                daemon=True,
            )
            process.start()
            ours.close()
            started.append((process, up))
        processes = cls([process for process, _ in started])
        deadline = time.monotonic() + START_WAIT_S
        for index, (process, up) in enumerate(started, start=1):
            while not up.wait(0.2):
                alive = process.is_alive()
                if not alive or time.monotonic() > deadline:
                    processes.stop(0.0)
                    why = "timed out" if alive else f"exited with status {process.exitcode}"
                    raise ServingProcessError(
                        f"--api-server-count: serving process {index} {why} while starting"
                    )
        return processes

    def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[str], None]) -> None:
        """Calls ``on_exit(why)`` on ``loop`` when a serving process exits unasked (before :meth:`stop`)."""
        for index, process in enumerate(self._processes, start=1):

            def exited(index: int = index, process: BaseProcess = process) -> None:
                loop.remove_reader(process.sentinel)
                if not self._stopping:
                    process.join(1.0)
                    on_exit(
                        f"serving process {index} (pid {process.pid}) exited with status {process.exitcode}"
                    )

            loop.add_reader(process.sentinel, exited)

    def terminate(self) -> None:
        """Asks each to drain and stop (SIGTERM), as the first serving process does."""
        self._stopping = True
        for process in self._processes:
            if process.is_alive():
                process.terminate()

    def stop(self, grace_period: float) -> None:
        """Asks each to stop and waits ``grace_period`` plus :data:`STOP_MARGIN_S` for them, then kills
        what is left (blocking)."""
        self.terminate()
        deadline = time.monotonic() + grace_period + STOP_MARGIN_S
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("serving process %s did not stop in time; killing it", process.pid)
                process.kill()
                process.join(STOP_MARGIN_S)


def serving_main(
    index: int, connection: Connection, config: WorkerConfig, engine_pid: int, up: Event, build: BuildServing
) -> None:
    """A serving process beyond the first: the engine process's pipe ``connection``, ``up`` set once
    it serves on the port; exits 0 after a drain, 3 when the engine stops, 2 when the port fails."""
    configure_logging(config.log_level, config.log_format, worker_id=config.resolved_worker_id)
    sys.exit(asyncio.run(_serve(index, connection, config, engine_pid, up, build)))


async def _serve(
    index: int, connection: Connection, config: WorkerConfig, engine_pid: int, up: Event, build: BuildServing
) -> int:
    loop = asyncio.get_running_loop()
    stop, failed = asyncio.Event(), asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def on_device_failure(_: BaseException) -> None:  # the pipe's reader thread
        with contextlib.suppress(RuntimeError):  # the loop is gone: the process is ending anyway
            loop.call_soon_threadsafe(failed.set)

    rules = TextRules.of(config)
    try:
        client, facts = await asyncio.to_thread(
            join_engine_process, engine_pid, connection, rules, on_device_failure, f"{index}/"
        )
    except ModelLoadError as error:
        log.error("serving process %d: %s", index, error.message)
        return EXIT_ENGINE_FAILED
    progress = LoadProgress()
    progress.advance(1.0)
    service = WorkerService(config.resolved_worker_id, progress)
    service.serving = build(config, client, facts)
    service.tracer = open_tracer(TRACE_SERVICE_NAME, config.otlp_traces_endpoint)
    grpc_server = GrpcServer(service, share_port=True)
    try:
        grpc_server.server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError as error:
        log.error("serving process %d: --port %d: %s", index, config.port, error)
        client.stop()
        return EXIT_PORT_TAKEN
    await grpc_server.server.start()
    await grpc_server.set_serving(True)
    freeze_startup_heap(log, f"serving process {index}")
    up.set()
    log.info(
        "serving process %d (pid %d) serving on %s:%d",
        index,
        multiprocessing.current_process().pid,
        config.host,
        config.port,
    )
    waits: set[asyncio.Future[Any]] = {
        asyncio.ensure_future(stop.wait()),
        asyncio.ensure_future(failed.wait()),
    }
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    code = EXIT_ENGINE_FAILED if failed.is_set() else 0
    await grpc_server.drain(0.0 if code else config.grace_period)
    await grpc_server.server.stop(0)
    client.stop()
    if service.tracer is not None:
        await asyncio.to_thread(service.tracer.close)
    for waiting in waits:
        waiting.cancel()
    return code
