"""The grammar token table is built on the first request that needs a grammar, not at load: a
worker that never sees one never pays its seconds of CPU; concurrent first requests build it once
and none compiles before it is whole (worker/sampling/grammar.py, docs/worker.md)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from worker import server
from worker.config import parse_config
from worker.sampling import grammar
from worker.sampling.grammar import GrammarCompiler, GrammarSpec

JSON = GrammarSpec(kind="json_object")


class CountedBuilds:
    """``grammar._ll_tokenizer`` counted; the first build waits for ``release`` once ``hold`` is set."""

    def __init__(self, hold: bool = False) -> None:
        self.calls = 0
        self.entered = threading.Event()  # the first build has started
        self.release = threading.Event()
        self.second = threading.Event()  # a second caller reached the build, or its lock
        self._real = grammar._ll_tokenizer
        if not hold:
            self.release.set()

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            self.second.set()
        self.entered.set()
        self.release.wait()
        return self._real(*args)


class ObservedLock:
    """A lock that says when a second thread asks for it while it is held."""

    def __init__(self, builds: CountedBuilds) -> None:
        self._lock = threading.Lock()
        self._builds = builds

    def __enter__(self) -> None:
        if self._lock.locked():
            self._builds.second.set()
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_worker_starts_without_the_table_and_builds_it_on_the_first_grammar(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    builds = CountedBuilds()
    monkeypatch.setattr(grammar, "_ll_tokenizer", builds)
    config = parse_config(["--fake-tokens", "--cache-dir", str(model_cache)], environ={})
    serving = server.build_serving(config)
    try:
        assert builds.calls == 0  # nothing built at load
        assert serving.grammars is not None
        with caplog.at_level(logging.INFO, logger="worker.sampling.grammar"):
            first = serving.grammars.validate(JSON)
            assert serving.grammars.validate(JSON) == first
        assert builds.calls == 1
        assert "grammar token table built" in caplog.text
    finally:
        serving.generator.stop()


def test_concurrent_first_grammars_build_the_table_once_and_wait_for_it(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = CountedBuilds(hold=True)
    monkeypatch.setattr(grammar, "_ll_tokenizer", builds)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    compiler = GrammarCompiler(tokenizer, {tokenizer.eos_token_id})
    compiler._building = ObservedLock(builds)  # type: ignore[assignment]
    sources: list[str] = []
    threads = [threading.Thread(target=lambda: sources.append(compiler.validate(JSON))) for _ in range(2)]
    threads[0].start()
    assert builds.entered.wait(60)
    threads[1].start()
    assert builds.second.wait(60)  # the second caller is at the lock (or, wrongly, building too)
    assert sources == []  # nothing compiled while the table is being built
    builds.release.set()
    for thread in threads:
        thread.join(60)
    assert builds.calls == 1
    assert len(sources) == 2 and sources[0] == sources[1]
