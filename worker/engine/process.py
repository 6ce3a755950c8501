"""The engine in its own process (``--engine-process``): a child loads the model and runs the step
loop; the serving process keeps gRPC, prompts and output processing. One pipe each way per serving
process (``--api-server-count``: the others' passed over the first): requests, a message per step.

Design notes: docs/worker.md ("The engine in its own process").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import signal
import threading
import weakref
from collections.abc import Callable, Iterable
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, Protocol

from sluice.heap import exit_without_collecting, freeze_startup_heap
from sluice.logs import configure_logging
from worker.config import WorkerConfig
from worker.engine.core import Engine
from worker.engine.failures import EngineFailure
from worker.engine.prepare import Prepared
from worker.engine.process_intake import Intake
from worker.engine.process_messages import (
    Abort,
    Acked,
    Attach,
    EngineFailed,
    FromEngine,
    LoadFailed,
    Loading,
    ModelConfig,
    ModelFacts,
    Outputs,
    Ready,
    Refusal,
    StatsReport,
    Stop,
    StopChoices,
    Submit,
    ToEngine,
)
from worker.engine.request_stream import RequestStream, StreamOpener
from worker.engine.sink import deliver, ended_outputs
from worker.engine.stats import EngineStats
from worker.errors import GenerationFailed, WorkerError
from worker.model.load_progress import LoadProgress
from worker.model.loader import LoadedModel, ModelLoadError
from worker.output.processor import TextRules
from worker.types import CoreFailure, CoreOutput, FinishReason, GenerationRequest, Progress

log = logging.getLogger(__name__)

# How long a stopping engine process may take before it is terminated.
STOP_WAIT_S = 10.0
# The exit status of an engine process whose pipe's reader failed (the serving process sees it go).
EXIT_PIPE_FAILED = 1
# The settings that put the engine in a process of its own, as refusals name them.
ENGINE_PROCESS_FLAGS = "--engine-process and --api-server-count"
# What a stream hears when the engine can no longer be reached (or its device failed).
ENGINE_STOPPED = "generation failed: the worker's engine stopped"
DEVICE_FAILED = "generation failed: the worker's device failed"


class _Sender:
    """One pipe end, written from several threads."""

    def __init__(self, connection: Connection):
        self._connection = connection
        self._lock = threading.Lock()

    def send(self, message: ToEngine | FromEngine) -> None:
        with self._lock:
            self._connection.send(message)

    def send_handing_over(self, message: ToEngine, connections: list[Connection], pid: int) -> None:
        """Sends ``message``, then each of ``connections``' descriptors (to process ``pid``), with
        nothing else between them on the pipe."""
        with self._lock:
            self._connection.send(message)
            for connection in connections:
                reduction.send_handle(self._connection, connection.fileno(), pid)

    def send_built(self, build: Callable[[], ToEngine | FromEngine | None]) -> None:
        """Sends what ``build()`` returns (nothing for None), built under the send lock: what it reads
        reaches the pipe in the order it was read."""
        with self._lock:
            message = build()
            if message is not None:
                self._connection.send(message)


# ------------------------------------------------------------------ the engine process


class _StatsOutbox:
    """The engine's published stats on their way to the serving process. The engine's loop offers
    each new copy (:class:`worker.engine.stats.PublishedStats`: a lock and an event, nothing more on
    its thread); a thread of this outbox sends it, unless a step's outputs leave first and carry it.
    A copy and the outputs go out under one lock, so the copy counting a request's end (published
    before that end is delivered) never reaches the serving process after the end."""

    def __init__(self, sender: _Sender):
        self._sender = sender
        self._lock = threading.Lock()
        self._pending: EngineStats | None = None
        self._wake = threading.Event()
        threading.Thread(target=self._forward, name="sluice-engine-stats", daemon=True).start()

    def offer(self, stats: EngineStats) -> None:
        with self._lock:
            self._pending = stats
        self._wake.set()

    def send_outputs(self, batches: list[tuple[str, list[CoreOutput]]]) -> None:
        self._sender.send_built(lambda: Outputs(batches, self._take()))

    def _take(self) -> EngineStats | None:
        with self._lock:
            stats, self._pending = self._pending, None
        return stats

    def _report(self) -> StatsReport | None:
        stats = self._take()
        return None if stats is None else StatsReport(stats)

    def _forward(self) -> None:
        while self._wake.wait():
            self._wake.clear()
            try:
                self._sender.send_built(self._report)
            except (OSError, ValueError):  # the pipe is closed: the engine process is ending
                return


class _PipeLoop:
    """Stands in for an event loop in :func:`worker.engine.sink.deliver`: a step's outputs for every
    request go to the serving process as one message."""

    def __init__(self, outbox: _StatsOutbox):
        self._outbox = outbox

    def call_soon_threadsafe(self, _: Callable[..., Any], items: list[tuple[Any, list[CoreOutput]]]) -> None:
        self.send(items)

    def send(self, items: list[tuple[Any, list[CoreOutput]]]) -> None:
        with contextlib.suppress(OSError, ValueError):  # that serving process is gone (the worker ends)
            self._outbox.send_outputs([(sink.key, outputs) for sink, outputs in items])


class _RemoteSink:
    """A request's outputs, for the serving process (:class:`worker.engine.sink.OutputSink`)."""

    def __init__(self, key: str, loop: _PipeLoop):
        self.key = key
        self._loop = loop

    @property
    def loop(self) -> _PipeLoop:
        return self._loop

    def put(self, outputs: list[CoreOutput]) -> None:
        self._loop.send([(self, outputs)])


class _SentProgress(LoadProgress):
    """The load's progress, also sent to the serving process."""

    def __init__(self, sender: _Sender):
        super().__init__()
        self._sender = sender

    def advance(self, fraction: float) -> None:
        super().advance(fraction)
        self._sender.send(Loading(self.fraction))


def _facts(loaded: LoadedModel, eos: Iterable[int], max_running: int) -> ModelFacts:
    model = (
        None
        if loaded.model is None
        else ModelConfig(loaded.model.config, getattr(loaded.model, "generation_config", None))
    )
    return ModelFacts(dataclasses.replace(loaded, model=model), frozenset(eos), max_running)


def engine_main(connection: Connection, config: WorkerConfig, build: Callable[..., Any]) -> None:
    """The engine process: loads the model with ``build`` (``worker.server.build_serving``), reports
    :class:`Ready` with its facts, then serves the serving process's requests until told to stop or
    the pipe closes (the serving process is gone); exits with :data:`EXIT_PIPE_FAILED` when a
    message cannot be read. Signals are the serving process's to handle: it drains, then stops
    this one. Pipes of more serving processes (:class:`Attach`) are served alongside, each on a
    thread of its own, until their process leaves."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(config.log_level, config.log_format, worker_id=config.resolved_worker_id)
    senders = _Senders(_Sender(connection))
    loaded = _load(senders, config, build)
    if loaded is None:
        return
    engine, facts = loaded
    intake = _intake(engine, senders.first)

    def attach(message: Attach) -> None:
        for _ in range(message.count):
            _attach(Connection(reduction.recv_handle(connection)), engine, facts, senders)

    try:
        served = _serve(connection, intake, attach)
    finally:
        intake.close()
        engine.stop()
    exit_without_collecting(0 if served else EXIT_PIPE_FAILED)


class _Senders:
    """Every serving process's pipe end: a device failure reaches each of them."""

    def __init__(self, first: _Sender):
        self.first = first
        self._all = [first]
        self._lock = threading.Lock()

    def add(self, sender: _Sender) -> None:
        with self._lock:
            self._all.append(sender)

    def failed(self, why: str) -> None:
        with self._lock:
            senders = list(self._all)
        for sender in senders:
            with contextlib.suppress(OSError, ValueError):  # that serving process is gone
                sender.send(EngineFailed(why))


def _intake(engine: Engine, sender: _Sender) -> Intake:
    """A serving process's intake: its requests queued in ``engine``, their outputs and the engine's
    stats back over its pipe."""
    outbox = _StatsOutbox(sender)
    engine.published.listen(outbox.offer)
    loop = _PipeLoop(outbox)
    return Intake(engine, sender.send, lambda key: _RemoteSink(key, loop))


def _attach(connection: Connection, engine: Engine, facts: ModelFacts, senders: _Senders) -> None:
    """Serves another serving process's pipe on a thread of its own: :class:`Ready`, then its
    requests, until it leaves (:class:`Stop`, or its pipe closes). Its requests then still queued
    run on, their outputs dropped: a serving process that leaves has drained, and one that died
    ends the worker."""
    sender = _Sender(connection)

    def serve() -> None:
        intake = _intake(engine, sender)
        try:
            sender.send(Ready(facts, engine.latest_stats()))
            _serve(connection, intake, None)
        except (OSError, ValueError):
            log.info("a serving process left before it was ready")
        finally:
            intake.close()
            connection.close()

    senders.add(sender)
    threading.Thread(target=serve, name="sluice-engine-attached", daemon=True).start()


def _load(
    senders: _Senders, config: WorkerConfig, build: Callable[..., Any]
) -> tuple[Engine, ModelFacts] | None:
    """Loads the model and reports :class:`Ready` (the engine running, and its facts for more
    serving processes), or :class:`LoadFailed` (None)."""
    sender = senders.first

    def device_failed(failure: BaseException) -> None:
        senders.failed(str(failure))

    try:
        serving = build(config, _SentProgress(sender), on_device_failure=device_failed)
    except ModelLoadError as error:
        sender.send(LoadFailed(error.message))
        return None
    except Exception as error:
        log.exception("loading the model failed")
        sender.send(LoadFailed(f"loading the model failed: {type(error).__name__}: {error}"))
        return None
    engine = serving.engine
    if not isinstance(engine, Engine):
        task = serving.loaded.task
        sender.send(LoadFailed(f"{ENGINE_PROCESS_FLAGS} serve generation only; this model's task is {task}"))
        return None
    freeze_startup_heap(log, "engine process")  # before any request can arrive
    try:
        facts = _facts(serving.loaded, engine.eos_token_ids, serving.max_running)
        sender.send(Ready(facts, engine.latest_stats()))
    except Exception as error:  # pickling: the tokenizer or processor cannot cross to the serving process
        log.exception("handing the model's tokenizer and configs to the serving process failed")
        engine.stop()
        why = f"{type(error).__name__}: {error}"
        sender.send(
            LoadFailed(f"{ENGINE_PROCESS_FLAGS}: the model's tokenizer or processor cannot be sent ({why})")
        )
        return None
    return engine, facts


def _serve(connection: Connection, intake: Intake, attach: Callable[[Attach], None] | None = None) -> bool:
    """Hands a serving process's messages to ``intake`` until told to stop or the pipe closes
    (True), or until a message cannot be read (False: what followed it cannot be trusted).
    ``attach`` takes more serving processes' pipes (the first serving process's pipe only)."""
    then = "the engine stops" if attach else "its pipe closes"
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            log.info("the serving process is gone; %s", then)
            return True
        except Exception:
            log.critical("a message from a serving process could not be read; %s", then, exc_info=True)
            return False
        if isinstance(message, Stop):
            return True
        try:
            if isinstance(message, Attach) and attach is not None:
                attach(message)
            else:
                _dispatch(message, intake)
        except Exception:  # one message's bug must not stop the engine
            log.exception("handling the serving process's %s failed", type(message).__name__)


def _dispatch(message: ToEngine, intake: Intake) -> None:
    match message:
        case Submit(key, request):
            intake.submit(key, request)
        case Abort() | StopChoices():
            intake.control(message)
        case _:
            log.error("the serving process sent an unexpected message: %r", type(message).__name__)


# ------------------------------------------------------------------ the serving process


class EngineClient:
    """The serving process's engine: :class:`Engine`'s API over the pipe to the engine process.
    Output processing (detokenizing, stop strings, parsing) runs here, on each stream's loop.

    Every stream ends: when the pipe's reader stops for any reason (the engine process exited, a
    message could not be read, :meth:`stop`) or the device fails, each open stream hears a failure
    and later requests are refused; unless it was stopped, the worker's device-failure hook runs
    (NOT_SERVING, then a non-zero exit)."""

    def __init__(
        self,
        process: EngineProcess,
        connection: Connection,
        facts: ModelFacts,
        stats: EngineStats,
        rules: TextRules,
        on_device_failure: Callable[[BaseException], None] | None,
        key_prefix: str = "",
    ):
        self._process = process
        self._key_prefix = key_prefix  # another serving process's keys never meet this one's
        self._connection = connection
        self._sender = _Sender(connection)
        self._opener = StreamOpener(facts.loaded.tokenizer, rules)
        self._on_device_failure = on_device_failure
        self.device_failure: BaseException | None = None
        self._gone: str | None = None  # why the engine can no longer be reached
        self._ids = itertools.count()
        self._streams: weakref.WeakValueDictionary[str, RequestStream] = weakref.WeakValueDictionary()
        self._acks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[FinishReason | None]]] = {}
        self._stats = stats
        self._lock = threading.Lock()
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="sluice-engine-pipe", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def prepare(self, request: GenerationRequest) -> Prepared:
        """The engine process prepares requests (their sampling state lives there): nothing to do."""
        return Prepared(request, [])

    async def queue(self, prepared: Prepared) -> RequestStream:
        """Sends the request to the engine process and waits for it to be queued; raises what refused
        it there (QueueFull, InvalidRequest)."""
        request = prepared.request
        key = f"{self._key_prefix}{request.request_id}#{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = self._opener.open(self, request, key)
        if stream.ended_while_priming:
            stream.put(ended_outputs(None))
            return stream
        future: asyncio.Future[FinishReason | None] = loop.create_future()
        with self._lock:
            if self.device_failure is not None:
                raise GenerationFailed(DEVICE_FAILED)
            if self._gone is not None:
                raise GenerationFailed(ENGINE_STOPPED)
            self._acks[key] = (loop, future)
            self._streams[key] = stream
        stream.put([Progress("queued", 0.0)])  # before anything the engine sends for it
        try:
            self._sender.send(Submit(key, request))
            ended = await future
        except BaseException as error:
            with self._lock:
                self._streams.pop(key, None)
                self._acks.pop(key, None)
            if isinstance(error, WorkerError):
                raise
            self.abort(key)  # the caller went away (the engine may have queued it), or it never left
            if isinstance(error, Exception):
                log.exception("sending %s to the engine process failed", key)
                raise GenerationFailed(f"generation failed: {type(error).__name__}") from error
            raise
        if ended is not None:
            stream.put(ended_outputs(ended))
        return stream

    def abort(self, key: str, *, failed: bool = False) -> None:
        self._send(Abort(key, failed))

    def stop_choices(self, key: str, choices: Iterable[int]) -> None:
        self._send(StopChoices(key, tuple(choices)))

    def attach(self, connections: list[Connection]) -> None:
        """Hands the engine process the ends of more serving processes' pipes
        (``--api-server-count``); it serves each alongside this one's."""
        pid = self._process.pid
        if pid is None:
            raise GenerationFailed(ENGINE_STOPPED)
        self._sender.send_handing_over(Attach(len(connections)), connections, pid)

    def latest_stats(self) -> EngineStats:
        """The last stats the engine process published (it sends them on its own: with the outputs
        of a step that ends a request, whenever it runs out of work, and at least every
        :data:`~worker.engine.stats.STATS_INTERVAL_S` while it steps). Never waits for it."""
        return self._stats

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Stops the engine process (it finishes its step and exits), terminating it if it does not;
        any stream still open then ends with a failure."""
        self._stopping = True
        self._send(Stop())
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s; terminating it", timeout)
            self._process.terminate()
            self._process.join(timeout)
        self._reader.join(timeout)

    def _send(self, message: ToEngine) -> bool:
        try:
            self._sender.send(message)
        except (OSError, ValueError):  # the engine process is gone: the reader says so
            return False
        return True

    # -------------------------------------------------------------- the reader thread

    def _read(self) -> None:
        """The pipe's reader: handles the engine process's messages until the pipe closes or a
        message cannot be read; then every open stream ends (:meth:`_unreachable`)."""
        why = "the engine process's pipe reader failed"  # the exception is logged as the thread ends
        try:
            why = self._read_messages()
        finally:
            self._unreachable(why)

    def _read_messages(self) -> str:
        """Handles messages until the pipe cannot be read any more; returns why."""
        while True:
            try:
                message = self._connection.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._process.join(1.0)
                return f"the engine process exited (status {self._process.exitcode})"
            except Exception as error:  # a message that cannot be decoded: what follows is not trusted
                log.exception("a message from the engine process could not be read")
                return f"a message from the engine process could not be read ({type(error).__name__})"
            try:
                self._handle(message)
            except Exception:  # one message's bug must not stop every stream's outputs
                log.exception("handling the engine process's %s failed", type(message).__name__)

    def _handle(self, message: FromEngine) -> None:
        match message:
            case Outputs(batches, stats):
                if stats is not None:  # before the outputs: a scrape after an end counts it
                    self._stats = stats
                streams = self._streams
                deliver((stream, outputs) for key, outputs in batches if (stream := streams.get(key)))
            case Acked(key, refusal, ended):
                self._settle(key, refusal, ended)
            case StatsReport(stats):
                self._stats = stats
            case EngineFailed(why):
                self._failed(EngineFailure(why))
            case _:
                log.error("the engine process sent an unexpected message: %r", type(message).__name__)

    def _settle(self, key: str, refusal: Refusal | None, ended: FinishReason | None) -> None:
        with self._lock:
            loop, future = self._acks.pop(key, (None, None))
        if loop is None or future is None:
            return

        def settle() -> None:
            if future.done():
                return
            if refusal is None:
                future.set_result(ended)
            else:
                future.set_exception(refusal.error())

        with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits for it
            loop.call_soon_threadsafe(settle)

    def _unreachable(self, why: str) -> None:
        """The pipe's reader stopped: every open stream and waiting request fails, later ones are
        refused; unless the engine was stopped, the worker reports its device failed."""
        with self._lock:
            self._gone = why
        if self._stopping:
            self._end_streams(ENGINE_STOPPED)
        else:
            log.critical("%s: failing every request", why)
            self._failed(EngineFailure(why), ENGINE_STOPPED)

    def _end_streams(self, message: str) -> None:
        """Ends every open stream and waiting request with a failure (a stream that already ended
        ignores it). Called once nothing more can come for them."""
        with self._lock:
            streams = list(self._streams.values())
            acks = list(self._acks)
        deliver((stream, [CoreFailure(message)]) for stream in streams)
        for key in acks:
            self._settle(key, Refusal(GenerationFailed, message), None)

    def _failed(self, failure: EngineFailure, message: str = DEVICE_FAILED) -> None:
        """The engine cannot go on: the worker's hook hears of it (once: it goes NOT_SERVING before
        a caller hears a failure), then every open stream ends with ``message`` (the engine process
        has failed them already, unless it is gone)."""
        with self._lock:
            first = self.device_failure is None
            if first:
                self.device_failure = failure
        if first and self._on_device_failure is not None:
            self._on_device_failure(failure)
        self._end_streams(message)


class EngineProcess(Protocol):
    """The engine process as the serving process watches it (the part of
    :class:`multiprocessing.Process` it uses)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def terminate(self) -> None: ...


def spawned_engine(config: WorkerConfig, build: Callable[..., Any]) -> tuple[EngineProcess, Connection]:
    """The engine process in a fresh interpreter (multiprocessing's "spawn"), running
    :func:`engine_main`; returns it and the serving process's end of its pipe."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(
        target=engine_main, args=(theirs, config, build), name="sluice-engine", daemon=True
    )
    process.start()
    theirs.close()
    return process, ours


# How the engine process starts; the tests' zygote forks one from an imported process instead
# (tests/zygote.py: the same engine_main, without seconds of imports).
spawn_engine: Callable[[WorkerConfig, Callable[..., Any]], tuple[EngineProcess, Connection]] = spawned_engine


def start_engine_process(
    config: WorkerConfig,
    build: Callable[..., Any],
    progress: LoadProgress,
    rules: TextRules,
    on_device_failure: Callable[[BaseException], None] | None,
) -> tuple[EngineClient, ModelFacts]:
    """Starts the engine process, which loads the model with ``build`` (a module-level function: the
    child imports it), and waits until it is loaded (blocking; run in a thread), raising
    ``progress`` as it reports; raises :class:`ModelLoadError` when it cannot load."""
    process, ours = spawn_engine(config, build)
    facts, stats = _wait_ready(process, ours, progress)
    return EngineClient(process, ours, facts, stats, rules, on_device_failure), facts


def join_engine_process(
    engine_pid: int,
    connection: Connection,
    rules: TextRules,
    on_device_failure: Callable[[BaseException], None] | None,
    key_prefix: str,
) -> tuple[EngineClient, ModelFacts]:
    """Another serving process's engine (``--api-server-count``): the running engine process
    ``engine_pid``, over the pipe the first serving process handed it (blocking until its
    :class:`Ready`); its keys start with ``key_prefix``."""
    process = _EngineElsewhere(engine_pid)
    facts, stats = _wait_ready(process, connection, LoadProgress())
    return EngineClient(process, connection, facts, stats, rules, on_device_failure, key_prefix), facts


def _wait_ready(
    process: EngineProcess, ours: Connection, progress: LoadProgress
) -> tuple[ModelFacts, EngineStats]:
    """Reads the engine process's messages until :class:`Ready`; raises :class:`ModelLoadError`
    when it cannot load (or cannot be read)."""
    while True:
        try:
            message = ours.recv()
        except (EOFError, OSError):
            process.join(5.0)
            raise ModelLoadError(
                f"the engine process exited while loading (status {process.exitcode})"
            ) from None
        except Exception as error:
            process.terminate()
            process.join(STOP_WAIT_S)
            raise ModelLoadError(
                f"a message from the engine process could not be read ({type(error).__name__}: {error})"
            ) from error
        match message:
            case Loading(fraction):
                progress.advance(fraction)
            case LoadFailed(why):
                process.join(STOP_WAIT_S)
                raise ModelLoadError(why)
            case Ready(facts, stats):
                return facts, stats
            case _:
                log.error("the engine process sent an unexpected message while loading: %r", message)


class _EngineElsewhere:
    """The engine process as another serving process sees it: not its child (the first serving
    process starts and stops it), so there is nothing to join or terminate."""

    def __init__(self, pid: int):
        self._pid = pid

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def exitcode(self) -> int | None:
        return None

    def is_alive(self) -> bool:
        return False  # for stop(): nothing of ours to wait for

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        pass
