"""The model loads in a thread of its own that is gone once loading ends (see worker.server.in_own_thread)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest
import transformers

from tests.processes import free_port
from worker import server
from worker.config import parse_config
from worker.model.loader import ModelLoadError
from worker.server import in_own_thread


def test_runs_in_a_new_thread_that_has_ended_when_the_result_arrives():
    async def main() -> tuple[threading.Thread, int]:
        return await in_own_thread(lambda x: (threading.current_thread(), x * 2), 21)

    ran_in, value = asyncio.run(main())
    assert value == 42
    assert ran_in is not threading.main_thread() and ran_in.name == "sluice-loader"
    ran_in.join(timeout=5)
    assert not ran_in.is_alive()
    # Not a thread of asyncio's executor, which would outlive the load with its OpenMP team.
    assert not any(t.name.startswith("asyncio_") for t in threading.enumerate())


def test_an_error_reaches_the_awaiting_task():
    def fail(_: None) -> None:
        raise ModelLoadError("no such model")

    async def main() -> None:
        await in_own_thread(fail, None)

    with pytest.raises(ModelLoadError, match="no such model"):
        asyncio.run(main())


def test_a_caller_that_stops_waiting_leaves_no_error_behind():
    finished = threading.Event()

    def slow(_: None) -> int:
        time.sleep(0.3)
        finished.set()
        return 1

    async def main() -> None:
        task = asyncio.ensure_future(in_own_thread(slow, None))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # the thread finishes and settles a cancelled future: ignored

    asyncio.run(main())
    assert finished.is_set()


def gemma4_folder(folder: Path) -> Path:
    """A folder holding only a tiny Gemma 4 text config (what names the architecture)."""
    transformers.Gemma4TextConfig(num_hidden_layers=2, architectures=["Gemma4ForCausalLM"]).save_pretrained(
        folder
    )
    return folder


def test_an_unexpected_error_at_load_becomes_one_line_naming_the_architecture(monkeypatch, tmp_path):
    def crash(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("'head_dim' is a per-layer attribute\nand a second line")

    monkeypatch.setattr(server, "load_configured", crash)
    config = parse_config(["--model", str(gemma4_folder(tmp_path))], environ={})
    with pytest.raises(ModelLoadError) as raised:
        server.build_serving(config)
    assert raised.value.message == (
        "Gemma4ForCausalLM (gemma4_text) cannot be served: loading it raised RuntimeError: "
        "'head_dim' is a per-layer attribute"
    )


def test_the_worker_ends_with_one_line_and_status_1_when_the_load_raises(monkeypatch, tmp_path, caplog):
    """Whatever the load raises, ``run`` logs one ERROR line and returns 1 (no traceback, no
    exception out of the event loop)."""

    def crash(*_args: object, **_kwargs: object) -> None:
        raise KeyError("gemma4")

    monkeypatch.setattr(server, "build_serving", crash)
    port = free_port()
    config = parse_config(
        ["--model", str(gemma4_folder(tmp_path)), "--port", str(port), "--metrics-port", "0"], environ={}
    )
    with caplog.at_level(logging.INFO):
        assert asyncio.run(server.run(config)) == 1
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert [record.getMessage() for record in errors] == [
        "Gemma4ForCausalLM (gemma4_text) cannot be served: loading it raised KeyError: 'gemma4'"
    ]
    assert all(record.exc_info is None for record in errors)
