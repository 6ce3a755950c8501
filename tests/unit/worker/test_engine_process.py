"""The engine process's pieces without processes (the processes themselves:
tests/integration/test_engine_process.py): how a refusal crosses the pipe, one message of outputs per
step, the model handed over without its weights, requests prepared off the pipe's reader (an abort
that arrives meanwhile applies in order), and the stats the engine process publishes on its own.
Every way the pipe can end: test_engine_process_ends.py."""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from worker.engine import process
from worker.engine.prepare import Prepared
from worker.engine.process_intake import ABORTED_WHILE_PREPARED, Intake
from worker.engine.process_messages import (
    Abort,
    Acked,
    EngineFailed,
    LoadFailed,
    Loading,
    Outputs,
    Refusal,
    StatsReport,
    Stop,
    StopChoices,
    Submit,
)
from worker.engine.stats import EngineCounters, EngineStats
from worker.errors import GenerationFailed, InvalidRequest, ModelLoading, QueueFull, WorkerError
from worker.model.load_progress import LoadProgress
from worker.model.loader import LoadedModel, ModelLoadError
from worker.output.processor import TextRules
from worker.types import FinishReason, GenerationRequest, NewToken, SamplingOptions

pytestmark = pytest.mark.slow  # left out of make test-fast

STATS = EngineStats(0, 0, 0, 0, 0, 0, 0, EngineCounters())


class Recorder:
    """A pipe end's sender that keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def send_built(self, build: Any) -> None:
        if (message := build()) is not None:
            self.sent.append(message)


def engine_that(prepare: Any = None, enqueue: Any = None, **more: Any) -> Any:
    return SimpleNamespace(
        prepare=prepare or (lambda request: Prepared(request, [])),
        enqueue=enqueue or (lambda prepared, key, sink: None),
        count_ended=lambda: None,
        **more,
    )


def answered(engine: Any, key: str = "k") -> Acked:
    """The answer of an :class:`Intake` over ``engine`` to one submitted request."""
    answers: queue.Queue[Acked] = queue.Queue()
    intake = Intake(engine, answers.put, lambda key: SimpleNamespace(key=key))
    intake.submit(key, None)  # type: ignore[arg-type]
    try:
        return answers.get(timeout=30)
    finally:
        intake.close()


def rebuilt(error: BaseException) -> WorkerError:
    """The exception the serving process raises for what the engine process refused with."""

    def refuse(request: object) -> Prepared:
        raise error

    answer = answered(engine_that(prepare=refuse))
    assert answer.refusal is not None and answer.ended is None
    return pickle.loads(pickle.dumps(answer)).refusal.error()  # type: ignore[no-any-return]


def test_a_refusal_keeps_its_kind_message_and_parameter() -> None:
    invalid = rebuilt(InvalidRequest("4 resumed tokens exceed max_tokens (2)", param="resume"))
    assert (
        type(invalid) is InvalidRequest
        and invalid.param == "resume"
        and invalid.message == "4 resumed tokens exceed max_tokens (2)"
    )
    full = rebuilt(QueueFull("the queue is full", retry_after_seconds=1.5))
    assert type(full) is QueueFull and full.retry_after_seconds == 1.5


def test_other_failures_become_generation_failed() -> None:
    assert type(rebuilt(ModelLoading("loading", load_fraction=0.5))) is GenerationFailed
    crashed = rebuilt(RuntimeError("boom"))
    assert type(crashed) is GenerationFailed and crashed.message == "generation failed: RuntimeError"


def test_a_request_its_resumed_tokens_ended_is_not_queued() -> None:
    queued: list[str] = []
    engine = engine_that(
        prepare=lambda request: Prepared(request, [], FinishReason.LENGTH),
        enqueue=lambda prepared, key, sink: queued.append(key),
    )
    assert answered(engine) == Acked("k", None, FinishReason.LENGTH)
    assert queued == []


def test_a_steps_outputs_for_every_request_are_one_message() -> None:
    recorder = Recorder()
    loop = process._PipeLoop(process._StatsOutbox(recorder))  # type: ignore[arg-type]
    sinks = [process._RemoteSink(f"r{i}", loop) for i in range(3)]
    token = NewToken(0, 7, 0.0)
    loop.call_soon_threadsafe(print, [(sink, [token]) for sink in sinks])
    assert recorder.sent == [Outputs([("r0", [token]), ("r1", [token]), ("r2", [token])])]
    sinks[1].put([token])
    assert recorder.sent[-1] == Outputs([("r1", [token])])


def test_the_model_goes_over_without_its_weights() -> None:
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(model_type="llama")  # type: ignore[assignment]
    model.generation_config = SimpleNamespace(eos_token_id=[5, 6])  # type: ignore[assignment]
    loaded = LoadedModel(model, None, "m", "s", 64, torch.device("cpu"), torch.float32, 0.0)  # type: ignore[arg-type]
    facts = pickle.loads(pickle.dumps(process._facts(loaded, {5, 6, 9}, 16)))
    assert isinstance(facts.loaded.model, process.ModelConfig)
    assert (
        facts.loaded.model.config.model_type == "llama"
        and facts.loaded.model.generation_config.eos_token_id == [5, 6]
    )
    assert facts.eos_token_ids == frozenset({5, 6, 9}) and facts.max_running == 16
    fake = LoadedModel(None, None, "m", "s", 64, torch.device("cpu"), torch.float32, 0.0)  # type: ignore[arg-type]
    assert process._facts(fake, set(), 1).loaded.model is None  # --fake-tokens: no model


@pytest.mark.parametrize("kind", [InvalidRequest, QueueFull])
def test_the_refusals_the_engine_raises_have_the_base_signature(kind: type[WorkerError]) -> None:
    """A refusal is rebuilt from (message, param, retry); a kind with another constructor would be
    reported as GenerationFailed instead."""
    assert kind.__init__ is WorkerError.__init__


def test_a_vision_models_processor_crosses_as_its_folder_and_tokenizer(
    tiny_vlm: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's processor without a video part is a class made at load; it pickles as the folder
    it was built from and its tokenizer, which a pickle of the loaded model shares with the model's
    own: the serving process gets the same processor and loads no tokenizer again."""
    import numpy as np
    from PIL import Image
    from transformers import PreTrainedTokenizerBase

    from worker.model.loader import _images_only_processor

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the tokenizer was loaded again")

    folder = tiny_vlm("qwen2_vl")
    processor = _images_only_processor(str(folder))
    sent = pickle.dumps((processor.tokenizer, processor))
    with monkeypatch.context() as patched:
        patched.setattr(PreTrainedTokenizerBase, "from_pretrained", classmethod(refuse))
        tokenizer, copy = pickle.loads(sent)
    assert type(copy).__name__ == type(processor).__name__ and copy.video_processor is None
    assert copy.tokenizer is tokenizer
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8))
    prompt = "<|vision_start|><|image_pad|><|vision_end|>"
    want, got = processor(text=prompt, images=[image]), copy(text=prompt, images=[image])
    assert np.array_equal(want["pixel_values"], got["pixel_values"]) and want["input_ids"] == got["input_ids"]


def client_on(connection: Any, stats: EngineStats = STATS) -> process.EngineClient:
    """An engine client on ``connection`` (no engine process behind it, no tokenizer)."""
    fake_process = SimpleNamespace(
        join=lambda timeout=None: None, exitcode=None, is_alive=lambda: False, pid=1, terminate=lambda: None
    )
    loaded = LoadedModel(None, object(), "m", "s", 64, torch.device("cpu"), torch.float32, 0.0)  # type: ignore[arg-type]
    return process.EngineClient(
        fake_process,  # type: ignore[arg-type]
        connection,
        process.ModelFacts(loaded, frozenset(), 1),
        stats,
        TextRules((), ""),
        None,
    )


def stats_with(finished: int) -> EngineStats:
    return EngineStats(1, 2, 3, 4, 5, 6, 7, EngineCounters(requests_finished=finished))


def test_a_message_the_reader_cannot_handle_does_not_stop_it() -> None:
    """One bad message from the engine process is logged; the next ones are still handled (else
    every stream would wait forever)."""
    ours, theirs = multiprocessing.Pipe()
    client = client_on(ours)
    theirs.send(Outputs(None))  # type: ignore[arg-type]  # its handling raises
    theirs.send(StatsReport(stats_with(3)))
    deadline = time.monotonic() + 30
    while client.latest_stats() != stats_with(3) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.latest_stats() == stats_with(3)
    client._stopping = True
    theirs.close()


def test_a_scrape_never_waits_for_the_engine_process() -> None:
    """The serving process reads the stats the engine process last published: the ones it sent when
    ready until others come, never asking for them (nobody reads the pipe here, and nothing is
    sent); a step's outputs carry newer ones before the outputs are delivered."""
    ours, theirs = multiprocessing.Pipe()
    client = client_on(ours, stats_with(0))
    assert client.latest_stats() == stats_with(0)
    assert not theirs.poll()  # the client asked nothing
    theirs.send(Outputs([], stats_with(1)))
    deadline = time.monotonic() + 30
    while client.latest_stats() != stats_with(1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.latest_stats() == stats_with(1)
    client._stopping = True
    theirs.close()


def test_typed_messages_cross_the_pipe_as_they_are() -> None:
    messages = [
        Submit("k", GenerationRequest("r", (1, 2), SamplingOptions(), 0.0)),
        Abort("k", failed=True),
        StopChoices("k", (0, 2)),
        Stop(),
        Acked("k", Refusal(QueueFull, "full", None, 1.5)),
        Outputs([("k", [NewToken(0, 7, 0.0)])], stats_with(2)),
        StatsReport(stats_with(2)),
        EngineFailed("CUDA error"),
    ]
    ours, theirs = multiprocessing.Pipe()
    for message in messages:
        ours.send(message)
        assert theirs.recv() == message


# ------------------------------------------------------------------ preparing off the pipe's reader


class PreparingEngine:
    """An engine whose preparation of request ``slow`` waits until released; it records the order in
    which requests are queued, aborted and stopped."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[tuple[str, str]] = []
        self.called = threading.Condition()

    def _record(self, what: str, key: str) -> None:
        with self.called:
            self.calls.append((what, key))
            self.called.notify_all()

    def wait_for(self, call: tuple[str, str]) -> bool:
        with self.called:
            return self.called.wait_for(lambda: call in self.calls, timeout=30)

    def prepare(self, request: GenerationRequest) -> Prepared:
        if request.request_id == "slow":
            assert self.release.wait(60), "never released"
        return Prepared(request, [])

    def enqueue(self, prepared: Prepared, key: str, sink: object) -> None:
        self._record("enqueue", key)

    def abort(self, key: str, *, failed: bool = False) -> None:
        self._record("abort", key)

    def stop_choices(self, key: str, choices: tuple[int, ...]) -> None:
        self._record("stop", key)

    def count_ended(self) -> None:
        pass


def a_request(name: str) -> GenerationRequest:
    return GenerationRequest(name, (1, 2), SamplingOptions(), 0.0)


@contextlib.contextmanager
def serving(engine: PreparingEngine) -> Iterator[tuple[Connection, queue.Queue[Acked]]]:
    """The engine process's pipe reader (``_serve``) over ``engine``, on a thread: yields the serving
    process's end of the pipe and the answers the intake sent."""
    ours, theirs = multiprocessing.Pipe()
    answers: queue.Queue[Acked] = queue.Queue()
    intake = Intake(engine, answers.put, lambda key: SimpleNamespace(key=key))  # type: ignore[arg-type]
    reader = threading.Thread(target=process._serve, args=(theirs, intake), daemon=True)
    reader.start()
    try:
        yield ours, answers
    finally:
        engine.release.set()
        ours.send(Stop())
        reader.join(30)
        intake.close()


def test_a_request_being_prepared_does_not_hold_up_the_pipe() -> None:
    """While one request's grammar compiles, the reader goes on: another request's abort applies
    and another request is prepared and queued."""
    engine = PreparingEngine()
    with serving(engine) as (pipe, answers):
        pipe.send(Submit("slow", a_request("slow")))
        pipe.send(Abort("running"))
        pipe.send(Submit("quick", a_request("quick")))
        assert engine.wait_for(("abort", "running")), "the abort waited for the preparation"
        assert answers.get(timeout=30) == Acked("quick")
        assert ("enqueue", "slow") not in engine.calls
        engine.release.set()
        assert answers.get(timeout=30) == Acked("slow")


def test_an_abort_that_arrives_while_its_request_is_prepared_is_not_lost() -> None:
    """The request is never queued (it would run with nobody reading it) and its acknowledgement
    says it was aborted; a stop that arrives meanwhile applies once its request is queued."""
    engine = PreparingEngine()
    with serving(engine) as (pipe, answers):
        pipe.send(Submit("slow", a_request("slow")))
        pipe.send(Abort("slow"))
        pipe.send(Abort("other"))  # the reader has passed the abort of "slow" once this applies
        assert engine.wait_for(("abort", "other"))
        engine.release.set()
        answer = answers.get(timeout=30)
        assert answer.key == "slow" and answer.refusal is not None
        assert answer.refusal.message == ABORTED_WHILE_PREPARED
        assert [call for call in engine.calls if call[1] == "slow"] == []
    engine = PreparingEngine()
    with serving(engine) as (pipe, answers):
        pipe.send(Submit("slow", a_request("slow")))
        pipe.send(StopChoices("slow", (0,)))
        pipe.send(Abort("other"))
        assert engine.wait_for(("abort", "other"))
        engine.release.set()
        assert answers.get(timeout=30) == Acked("slow")
        assert [call for call in engine.calls if call[1] == "slow"] == [("enqueue", "slow"), ("stop", "slow")]


def test_a_model_that_does_not_generate_is_refused_in_one_line_naming_both_settings() -> None:
    """``--task embed`` in a process of its own (``--engine-process``, or ``--api-server-count``
    above 1, which implies it): the load fails with one line, and nothing else is sent."""
    pipe = Recorder()
    serving = SimpleNamespace(engine=object(), loaded=SimpleNamespace(task="embed"))
    senders = process._Senders(pipe)  # type: ignore[arg-type]
    assert process._load(senders, SimpleNamespace(), lambda *_, **__: serving) is None  # type: ignore[arg-type]
    assert pipe.sent == [
        LoadFailed(
            "--engine-process and --api-server-count serve generation only; this model's task is embed"
        )
    ]


class Exited(Exception):
    """Raised by the stand-in for :func:`sluice.heap.exit_without_collecting` with the status."""


@pytest.mark.parametrize(("served", "status"), [(True, 0), (False, process.EXIT_PIPE_FAILED)])
def test_the_engine_process_ends_without_the_interpreters_teardown(
    monkeypatch: pytest.MonkeyPatch, served: bool, status: int
) -> None:
    """Once served (or once a message could not be read), the engine process stops its engine and
    exits without the teardown's collections of its start-up heap (seconds of CPU)."""
    events: list[str] = []
    engine = SimpleNamespace(
        published=SimpleNamespace(listen=lambda _: None), stop=lambda: events.append("stop")
    )

    def exit_now(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(process.signal, "signal", lambda *_: None)
    monkeypatch.setattr(process, "configure_logging", lambda *_, **__: None)
    monkeypatch.setattr(process, "_load", lambda *_: (engine, None))  # the engine and its facts
    monkeypatch.setattr(process, "Intake", lambda *_: SimpleNamespace(close=lambda: events.append("close")))
    monkeypatch.setattr(process, "_serve", lambda *_: served)
    monkeypatch.setattr(process, "exit_without_collecting", exit_now)
    config = SimpleNamespace(log_level="info", log_format="text", resolved_worker_id="w")
    with pytest.raises(Exited) as exited:
        process.engine_main(Recorder(), config, lambda *_: None)  # type: ignore[arg-type]
    assert exited.value.args == (status,)
    assert events == ["close", "stop"]


def test_the_engine_process_is_started_by_the_spawn_engine_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """``start_engine_process`` starts its engine with ``process.spawn_engine`` (a fresh interpreter
    by default; the tests' zygote forks one instead), then hears the load over the pipe end the hook
    returns and waits for the process it returned."""
    assert process.spawn_engine is process.spawned_engine
    ours, theirs = multiprocessing.Pipe()
    started: list[tuple[Any, Any]] = []
    joined: list[float | None] = []
    child = SimpleNamespace(
        join=joined.append, exitcode=None, is_alive=lambda: False, pid=1, terminate=lambda: None
    )

    def spawn(config: Any, build: Any) -> tuple[Any, Connection]:
        started.append((config, build))
        return child, ours

    monkeypatch.setattr(process, "spawn_engine", spawn)
    config, build, progress = SimpleNamespace(), object(), LoadProgress()
    theirs.send(Loading(0.5))
    theirs.send(LoadFailed("no such model"))
    with pytest.raises(ModelLoadError, match="no such model"):
        process.start_engine_process(config, build, progress, TextRules((), ""), None)  # type: ignore[arg-type]
    assert started == [(config, build)] and progress.fraction == 0.5 and joined == [process.STOP_WAIT_S]
