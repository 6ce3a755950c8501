"""The engine process's pieces without processes (the processes themselves:
tests/integration/test_engine_process.py): how a refusal crosses the pipe, one message of outputs per
step, the model handed over without its weights."""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from worker.engine import process
from worker.engine.prepare import Prepared
from worker.errors import GenerationFailed, InvalidRequest, ModelLoading, QueueFull, WorkerError
from worker.model.loader import LoadedModel
from worker.types import FinishReason, NewToken


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def send(self, message: tuple[Any, ...]) -> None:
        self.sent.append(message)


def engine_that(prepare: Any = None, enqueue: Any = None) -> Any:
    return SimpleNamespace(
        prepare=prepare or (lambda request: Prepared(request, [])),
        enqueue=enqueue or (lambda prepared, key, sink: None),
        count_ended=lambda: None,
    )


def rebuilt(error: BaseException) -> WorkerError:
    """The exception the serving process raises for what the engine process refused with."""

    def refuse(request: object) -> Prepared:
        raise error

    refusal, ended = process._admit(engine_that(prepare=refuse), None, "k", None)  # type: ignore[arg-type]
    assert refusal is not None and ended is None
    pickled = pickle.loads(pickle.dumps(refusal))
    kind, message, param, retry = pickled
    return kind(message, param=param, retry_after_seconds=retry)  # type: ignore[no-any-return]


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
    assert process._admit(engine, None, "k", None) == (None, FinishReason.LENGTH)  # type: ignore[arg-type]
    assert queued == []


def test_a_steps_outputs_for_every_request_are_one_message() -> None:
    recorder = Recorder()
    loop = process._PipeLoop(recorder)  # type: ignore[arg-type]
    sinks = [process._RemoteSink(f"r{i}", loop) for i in range(3)]
    token = NewToken(0, 7, 0.0)
    loop.call_soon_threadsafe(print, [(sink, [token]) for sink in sinks])
    assert recorder.sent == [("out", [("r0", [token]), ("r1", [token]), ("r2", [token])])]
    sinks[1].put([token])
    assert recorder.sent[-1] == ("out", [("r1", [token])])


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


def test_a_vision_models_processor_crosses_as_its_folder(tmp_path: Path) -> None:
    """The loader's processor without a video part is a class made at load; it pickles as the folder
    it was built from, so the serving process gets the same processor."""
    import numpy as np
    from PIL import Image

    from tests.tiny_vlms import build_tiny_vlm
    from worker.model.loader import _images_only_processor

    folder = build_tiny_vlm("qwen2_vl", tmp_path / "qwen2_vl")
    processor = _images_only_processor(str(folder))
    copy = pickle.loads(pickle.dumps(processor))
    assert type(copy).__name__ == type(processor).__name__ and copy.video_processor is None
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8))
    prompt = "<|vision_start|><|image_pad|><|vision_end|>"
    want, got = processor(text=prompt, images=[image]), copy(text=prompt, images=[image])
    assert np.array_equal(want["pixel_values"], got["pixel_values"]) and want["input_ids"] == got["input_ids"]


def test_a_message_the_reader_cannot_handle_does_not_stop_it() -> None:
    """One bad message from the engine process is logged; the next ones are still handled (else
    every stream would wait forever)."""
    import multiprocessing

    from worker.engine.stats import EngineCounters, EngineStats
    from worker.output.processor import TextRules

    ours, theirs = multiprocessing.Pipe()
    fake_process = SimpleNamespace(
        join=lambda timeout=None: None, exitcode=None, is_alive=lambda: False, pid=1
    )
    loaded = LoadedModel(None, object(), "m", "s", 64, torch.device("cpu"), torch.float32, 0.0)  # type: ignore[arg-type]
    client = process.EngineClient(
        fake_process,  # type: ignore[arg-type]
        ours,
        process.ModelFacts(loaded, frozenset(), 1),
        TextRules((), ""),
        None,
    )
    theirs.send(("ack",))  # malformed: no key
    stats = EngineStats(1, 2, 3, 4, 5, 6, 7, EngineCounters())
    theirs.send(("stats", -1, stats))
    client._stopping = True
    deadline = time.monotonic() + 5
    while client._stats is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client._stats == stats
    theirs.close()
