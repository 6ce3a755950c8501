"""The engine in its own process (``--engine-process``): a child loads the model and runs the step
loop; the serving process keeps gRPC, prompts and output processing, so neither waits for the
other's interpreter. They talk over one pipe: a request each way, one message of outputs per step.

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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from sluice.heap import freeze_startup_heap
from sluice.logs import configure_logging
from worker.config import WorkerConfig
from worker.engine.core import DeviceFailure, Engine, deliver, ended_outputs
from worker.engine.prepare import Prepared
from worker.engine.request_stream import RequestStream, StreamOpener
from worker.engine.stats import EngineStats
from worker.errors import GenerationFailed, WorkerError
from worker.model.load_progress import LoadProgress
from worker.model.loader import LoadedModel, ModelLoadError
from worker.output.processor import TextRules
from worker.types import CoreFailure, CoreOutput, FinishReason, GenerationRequest, Progress

log = logging.getLogger(__name__)

# How long a stats call waits for the engine process before answering with the last stats it had.
STATS_WAIT_S = 2.0
# How long a stopping engine process may take before it is terminated.
STOP_WAIT_S = 10.0


@dataclass(frozen=True)
class ModelConfig:
    """What the serving process keeps of the model: its configs (family, vision, end tokens)."""

    config: Any
    generation_config: Any = None


@dataclass(frozen=True)
class ModelFacts:
    """What the engine process hands the serving process once loaded: the model without its weights
    (tokenizer, configs, processor), its end tokens and the engine's running limit."""

    loaded: LoadedModel
    eos_token_ids: frozenset[int]
    max_running: int


class _Sender:
    """One pipe end, written from several threads."""

    def __init__(self, connection: Connection):
        self._connection = connection
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            self._connection.send(message)


# ------------------------------------------------------------------ the engine process


class _PipeLoop:
    """Stands in for an event loop in :func:`worker.engine.core.deliver`: a step's outputs for every
    request go to the serving process as one message."""

    def __init__(self, sender: _Sender):
        self._sender = sender

    def call_soon_threadsafe(self, _: Callable[..., Any], items: list[tuple[Any, list[CoreOutput]]]) -> None:
        self.send(items)

    def send(self, items: list[tuple[Any, list[CoreOutput]]]) -> None:
        self._sender.send(("out", [(sink.key, outputs) for sink, outputs in items]))


class _RemoteSink:
    """A request's outputs, for the serving process (:class:`worker.engine.core.OutputSink`)."""

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
        self._sender.send(("progress", self.fraction))


def _facts(loaded: LoadedModel, eos: Iterable[int], max_running: int) -> ModelFacts:
    model = (
        None
        if loaded.model is None
        else ModelConfig(loaded.model.config, getattr(loaded.model, "generation_config", None))
    )
    return ModelFacts(dataclasses.replace(loaded, model=model), frozenset(eos), max_running)


def engine_main(connection: Connection, config: WorkerConfig, build: Callable[..., Any]) -> None:
    """The engine process: loads the model with ``build`` (``worker.server.build_serving``), reports
    ``ready`` with its facts, then serves the serving process's requests until told to stop or the
    pipe closes (the serving process is gone). Signals are the serving process's to handle: it
    drains, then stops this one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(config.log_level, config.log_format, worker_id=config.resolved_worker_id)
    sender = _Sender(connection)

    def device_failed(failure: BaseException) -> None:
        sender.send(("device_failed", str(failure)))

    try:
        serving = build(config, _SentProgress(sender), on_device_failure=device_failed)
    except ModelLoadError as error:
        sender.send(("load_failed", error.message))
        return
    except Exception as error:
        log.exception("loading the model failed")
        sender.send(("load_failed", f"loading the model failed: {type(error).__name__}: {error}"))
        return
    engine = serving.engine
    if not isinstance(engine, Engine):
        task = serving.loaded.task
        sender.send(("load_failed", f"--engine-process serves generation only; this model's task is {task}"))
        return
    freeze_startup_heap(log, "engine process")  # before any request can arrive
    try:
        sender.send(("ready", _facts(serving.loaded, engine.eos_token_ids, serving.max_running)))
    except Exception as error:  # pickling: the tokenizer or processor cannot cross to the serving process
        log.exception("handing the model's tokenizer and configs to the serving process failed")
        engine.stop()
        why = f"{type(error).__name__}: {error}"
        sender.send(
            ("load_failed", f"--engine-process: the model's tokenizer or processor cannot be sent ({why})")
        )
        return
    loop = _PipeLoop(sender)
    try:
        _serve(connection, sender, engine, loop)
    finally:
        engine.stop()


def _serve(connection: Connection, sender: _Sender, engine: Engine, loop: _PipeLoop) -> None:
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            log.info("the serving process is gone; the engine stops")
            return
        if message[0] == "stop":
            return
        try:
            _handle(message, sender, engine, loop)
        except Exception:  # one message's bug must not stop the engine
            log.exception("handling the serving process's %r message failed", message[0])


def _handle(message: tuple[Any, ...], sender: _Sender, engine: Engine, loop: _PipeLoop) -> None:
    kind = message[0]
    if kind == "submit":
        _, key, request = message
        sender.send(("ack", key, *_admit(engine, loop, key, request)))
    elif kind == "abort":
        engine.abort(message[1], failed=message[2])
    elif kind == "stop_choices":
        engine.stop_choices(message[1], message[2])
    elif kind == "stats":
        sender.send(("stats", message[1], engine.stats()))


def _admit(
    engine: Engine, loop: _PipeLoop, key: str, request: GenerationRequest
) -> tuple[tuple[type[WorkerError], str, str | None, float | None] | None, FinishReason | None]:
    """Prepares and queues a request: (the error that refused it, or None; how its resumed tokens
    already ended it, or None)."""
    try:
        prepared = engine.prepare(request)
        if prepared.ended is not None:
            engine.count_ended()
            return None, prepared.ended
        engine.enqueue(prepared, key, _RemoteSink(key, loop))
    except WorkerError as error:
        kind = type(error) if type(error).__init__ is WorkerError.__init__ else GenerationFailed
        return (kind, error.message, error.param, error.retry_after_seconds), None
    except Exception as error:
        log.exception("queueing %s failed", key)
        return (GenerationFailed, f"generation failed: {type(error).__name__}", None, None), None
    return None, None


# ------------------------------------------------------------------ the serving process


class EngineClient:
    """The serving process's engine: :class:`Engine`'s API over the pipe to the engine process.
    Output processing (detokenizing, stop strings, parsing) runs here, on each stream's loop."""

    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        connection: Connection,
        facts: ModelFacts,
        rules: TextRules,
        on_device_failure: Callable[[BaseException], None] | None,
    ):
        self._process = process
        self._connection = connection
        self._sender = _Sender(connection)
        self._opener = StreamOpener(facts.loaded.tokenizer, rules)
        self._on_device_failure = on_device_failure
        self.device_failure: BaseException | None = None
        self._ids = itertools.count()
        self._streams: weakref.WeakValueDictionary[str, RequestStream] = weakref.WeakValueDictionary()
        self._acks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[FinishReason | None]]] = {}
        self._stats: EngineStats | None = None
        self._stats_asked: dict[int, threading.Event] = {}
        self._stats_tokens = itertools.count()
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

    async def admit(self, prepared: Prepared) -> RequestStream:
        """Sends the request to the engine process and waits for it to be queued; raises what refused
        it there (QueueFull, InvalidRequest)."""
        request = prepared.request
        key = f"{request.request_id}#{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = self._opener.open(self, request, key)
        if stream.ended_while_priming:
            stream.put(ended_outputs(None))
            return stream
        future: asyncio.Future[FinishReason | None] = loop.create_future()
        with self._lock:
            if self.device_failure is not None:
                raise GenerationFailed("generation failed: the worker's device failed")
            self._acks[key] = (loop, future)
            self._streams[key] = stream
        stream.put([Progress("queued", 0.0)])  # before anything the engine sends for it
        try:
            self._sender.send(("submit", key, request))
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
        self._send(("abort", key, failed))

    def stop_choices(self, key: str, choices: Iterable[int]) -> None:
        self._send(("stop_choices", key, tuple(choices)))

    def stats(self) -> EngineStats:
        """The engine process's stats (the last ones it sent, if it does not answer in time)."""
        token = next(self._stats_tokens)
        answered = threading.Event()
        with self._lock:
            self._stats_asked[token] = answered
        if self._send(("stats", token)):
            answered.wait(STATS_WAIT_S)
        with self._lock:
            self._stats_asked.pop(token, None)
            if self._stats is None:
                raise GenerationFailed("the engine process has not reported its stats")
            return self._stats

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Stops the engine process (it finishes its step and exits), terminating it if it does not."""
        self._stopping = True
        self._send(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s; terminating it", timeout)
            self._process.terminate()
            self._process.join(timeout)

    def _send(self, message: tuple[Any, ...]) -> bool:
        try:
            self._sender.send(message)
        except (OSError, ValueError):  # the engine process is gone: the reader says so
            return False
        return True

    # -------------------------------------------------------------- the reader thread

    def _read(self) -> None:
        while True:
            try:
                message = self._connection.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._process.join(1.0)
                    self._lost(f"the engine process exited (status {self._process.exitcode})")
                return
            try:
                self._handle(message)
            except Exception:  # one message's bug must not stop every stream's outputs
                log.exception("handling the engine process's %r message failed", message[0])

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "out":
            streams = self._streams
            deliver((stream, outputs) for key, outputs in message[1] if (stream := streams.get(key)))
        elif kind == "ack":
            self._settle(*message[1:])
        elif kind == "stats":
            with self._lock:
                self._stats = message[2]
                answered = self._stats_asked.get(message[1])
            if answered is not None:
                answered.set()
        elif kind == "device_failed":
            self._failed(DeviceFailure(message[1]))

    def _settle(self, key: str, error: tuple[Any, ...] | None, ended: FinishReason | None) -> None:
        with self._lock:
            loop, future = self._acks.pop(key, (None, None))
        if loop is None or future is None:
            return

        def settle() -> None:
            if future.done():
                return
            if error is None:
                future.set_result(ended)
            else:
                kind, text, param, retry = error
                future.set_exception(kind(text, param=param, retry_after_seconds=retry))

        with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits for it
            loop.call_soon_threadsafe(settle)

    def _lost(self, why: str) -> None:
        """The engine process is gone: every request fails, and the worker reports its device failed."""
        log.critical("%s: failing every request", why)
        with self._lock:
            streams = list(self._streams.values())
            acks = list(self._acks.items())
        deliver(
            (stream, [CoreFailure("generation failed: the worker's engine stopped")]) for stream in streams
        )
        for key, _ in acks:
            self._settle(
                key, (GenerationFailed, "generation failed: the worker's engine stopped", None, None), None
            )
        self._failed(DeviceFailure(why))

    def _failed(self, failure: DeviceFailure) -> None:
        with self._lock:
            if self.device_failure is not None:
                return
            self.device_failure = failure
        if self._on_device_failure is not None:
            self._on_device_failure(failure)


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
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(
        target=engine_main, args=(theirs, config, build), name="sluice-engine", daemon=True
    )
    process.start()
    theirs.close()
    while True:
        try:
            message = ours.recv()
        except (EOFError, OSError):
            process.join(5.0)
            raise ModelLoadError(
                f"the engine process exited while loading (status {process.exitcode})"
            ) from None
        if message[0] == "progress":
            progress.advance(message[1])
        elif message[0] == "load_failed":
            process.join(STOP_WAIT_S)
            raise ModelLoadError(message[1])
        elif message[0] == "ready":
            facts: ModelFacts = message[1]
            return EngineClient(process, ours, facts, rules, on_device_failure), facts
