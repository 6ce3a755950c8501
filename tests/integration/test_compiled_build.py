"""``make compiled``: the worker's per-token modules, built by mypyc in a copy of this tree, serve
exactly what the source does, and a source edited after the build stops the worker in one line."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.json_format import MessageToDict

from sluice.compiled import MODULES, extension_of
from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import REPO_ROOT, WorkerProcess, free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(2400),
    pytest.mark.skipif(
        not (shutil.which("cc") and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()),
        reason="`make compiled` needs a C compiler (cc) and Python's headers (Python.h)",
    ),
]

BUILD_TIMEOUT_S = 1500  # mypy's check of the worker, then the C compiler: about 5 minutes on 2 cores


def _source_only(folder: str, names: list[str]) -> set[str]:
    """What a copy of the tree leaves out: caches, and what a build here left (it is rebuilt)."""
    return {n for n in names if n in {"__pycache__", "build"} or n.endswith((".so", ".pyc"))}


@pytest.fixture(scope="module")
def compiled_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("compiled") / "tree"
    for folder in ("sluice", "worker", "tools"):
        shutil.copytree(REPO_ROOT / folder, root / folder, ignore=_source_only)
    shutil.copy(REPO_ROOT / "pyproject.toml", root / "pyproject.toml")  # mypy's settings
    build = subprocess.run(
        [sys.executable, "-m", "tools.compile"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert all(extension_of(root / name) is not None for name in MODULES)
    return root


@pytest.fixture(scope="module")
def compiled_worker(
    compiled_tree: Path, model_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    log_dir = tmp_path_factory.mktemp("compiled-worker-log")
    with WorkerProcess(cache_dir=model_cache, log_dir=log_dir, root=compiled_tree) as worker:
        yield worker


def requests() -> list[pb.GenerateRequest]:
    """Greedy with a stop string, seeded sampling of two choices with penalties, and log
    probabilities: the engine's, the sampler's and the output processing's paths."""

    def chat(text: str, **sampling: Any) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=text)]),
            sampling=pb.SamplingParams(**sampling),
        )

    return [
        chat("Count from one to twenty in words.", temperature=0, max_tokens=40, stop=["seven"]),
        chat(
            "Tell me a short story.",
            temperature=0.9,
            top_p=0.95,
            seed=7,
            n=2,
            max_tokens=24,
            frequency_penalty=0.5,
        ),
        chat("Name a colour.", temperature=0, max_tokens=8, logprobs=3),
    ]


def served(address: str, request: pb.GenerateRequest) -> list[dict[str, Any]]:
    """The call's events, without what names the worker or the request, timings, and the cached
    prompt tokens (the shared source worker may have served a prompt before)."""
    with grpc.insecure_channel(address) as channel:
        events = [MessageToDict(e) for e in pb_grpc.WorkerStub(channel).Generate(request, timeout=120)]
    for event in events:
        for key in ("requestId", "workerId"):
            event.get("started", {}).pop(key, None)
        event.get("usage", {}).pop("cachedTokens", None)
        for part in event.values():
            part.pop("timings", None)
    return events


def test_the_compiled_worker_serves_what_the_source_serves(compiled_worker, default_worker) -> None:
    count = len(MODULES)
    assert f"per-token modules: {count} of {count} compiled (mypyc)" in compiled_worker.log_path.read_text()
    for request in requests():
        compiled = served(compiled_worker.address, request)
        assert "usage" in compiled[-1], compiled[-3:]
        assert compiled == served(default_worker.address, request)


def test_a_source_edited_after_the_build_stops_the_worker_in_one_line(compiled_tree: Path) -> None:
    edited = compiled_tree / MODULES[-1]
    original = edited.read_bytes()
    edited.write_bytes(original + b"\n# edited\n")
    try:
        port = free_port()
        done = subprocess.run(
            [sys.executable, "-m", "worker", "--port", str(port), "--metrics-port", "0"],
            cwd=compiled_tree,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        edited.write_bytes(original)
    assert done.returncode == 1, done.stderr
    assert f"{MODULES[-1]} changed since `make compiled` built it" in done.stderr
    assert "Traceback" not in done.stderr
