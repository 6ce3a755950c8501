"""Starts the gRPC server, loads the model, and drains on SIGTERM/SIGINT.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from sluice import compiled
from sluice.heap import freeze_startup_heap
from sluice.ports import EXIT_PORT_TAKEN, PortUnavailableError, check_port_free
from sluice.tracing import open_tracer
from worker import metrics
from worker.attention.host_kv import HostKV
from worker.config import WorkerConfig
from worker.engine.core import Engine
from worker.engine.host_tier import HostTier, auto_offload_bytes, available_host_bytes, tiered
from worker.engine.options import EngineOptions
from worker.engine.pooling import PoolingEngine
from worker.engine.process import EngineClient, start_engine_process
from worker.engine.process_messages import ModelFacts
from worker.engine.speculation import Speculation
from worker.lora.registry import LoraRegistry, lora_registry
from worker.model.architecture import unexpected_load_error
from worker.model.device import bind_device
from worker.model.draft import DraftModel
from worker.model.fake_runner import fake_slow_load, load_fake_model
from worker.model.load_progress import LoadProgress
from worker.model.loader import LoadedModel, ModelLoadError, load_model
from worker.model.pooling_runner import PoolingRunner
from worker.model.runner import ModelRunner
from worker.model.runner_setup import (
    batch_limits,
    fake_runner,
    load_configured,
    model_runner,
    prefill_tokens,
)
from worker.model.vision import vision_spec
from worker.output.processor import TextRules
from worker.parallel.ranks import lead_ranks
from worker.prompts.family import FamilyProfile, choose_profile
from worker.prompts.images import ImageProcessing
from worker.prompts.prompt import PromptRenderer
from worker.prompts.vocabulary import TokenIndex
from worker.sampling.grammar import GrammarCompiler
from worker.service.grpc_server import EXIT_ENGINE_FAILED, GrpcServer
from worker.service.servicer import ServingModel, WorkerService
from worker.service.tracing import SERVICE_NAME as TRACE_SERVICE_NAME
from worker.serving_processes import ServingProcessError, ServingProcesses

log = logging.getLogger(__name__)


def eos_token_ids(loaded_model: object, tokenizer: object) -> set[int]:
    ids: set[int] = set()
    configured = getattr(getattr(loaded_model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, list | tuple):
        ids.update(int(i) for i in configured)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return ids


def family_profile(config: WorkerConfig, model: object, tokenizer: object) -> FamilyProfile:
    """The model family's formats (worker.prompts.family), from the settings and the template."""
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "")
    template = Path(config.chat_template).read_text() if config.chat_template else None
    return choose_profile(
        model_type,
        tokenizer,
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
        template=template,
        default_kwargs=json.loads(config.default_chat_template_kwargs),
    )


def stop_token_ids(profile: FamilyProfile, tokenizer: object) -> set[int]:
    """The family's extra end-of-turn tokens (gpt-oss's ``<|call|>``) that the vocabulary has."""
    vocab = TokenIndex(tokenizer)
    return {vocab[token] for token in profile.stop_tokens if token in vocab}


def build_serving(
    config: WorkerConfig,
    progress: LoadProgress | None = None,
    on_device_failure: Callable[[BaseException], None] | None = None,
) -> ServingModel:
    """Loads the model and starts the engine (blocking; run in a thread), raising ``progress``
    at the load's stages (1.0 once the engine runs); ``on_device_failure``: see :class:`Engine`.
    Raises :class:`ModelLoadError` for every failure, an unexpected exception included (one line
    naming the architecture: :func:`unexpected_load_error`)."""
    try:
        return _build_serving(config, progress or LoadProgress(), on_device_failure)
    except ModelLoadError:
        raise
    except Exception as error:
        raise unexpected_load_error(error, config.model) from error


def _build_serving(
    config: WorkerConfig,
    progress: LoadProgress,
    on_device_failure: Callable[[BaseException], None] | None,
) -> ServingModel:
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    runner: ModelRunner
    speculation = None
    if config.fake_tokens:  # benchmarks only: no model (worker/model/fake_runner.py)
        if not config.torch_threads:
            # Only small tensor ops are left; extra OpenMP threads would spin against the edge.
            torch.set_num_threads(1)
        loaded = load_fake_model(
            config.model, served_model_name=config.served_model_name, cache_dir=config.cache_dir
        )
        fake_slow_load(config.fake_load_seconds, progress)
        runner = fake_runner(loaded, config)
        limits = batch_limits(config, loaded.device, runner.num_blocks * runner.block_size)
    elif config.tensor_parallel_size > 1:  # rank 0 of a tensor-parallel group (worker/parallel/)
        loaded, runner, limits = lead_ranks(config, progress.advance, on_device_failure)
        # The proposer runs on rank 0 alone (a draft model whole, on its device); the verifying
        # forwards are steps like any other, which rank 0 tells the followers.
        speculation = speculation_of(config, loaded)
    else:
        loaded = load_configured(config, progress.advance)
        if loaded.task != "generate":
            return pooling_serving(config, loaded, progress, on_device_failure)
        bind_device(loaded.device)  # this thread builds the pool, checks the kernel, captures graphs
        speculation = speculation_of(config, loaded)
        runner, limits = model_runner(loaded, config)
    tier = host_tier(config, runner)
    loras = served_loras(config, runner, loaded)
    profile = family_profile(config, loaded.model, loaded.tokenizer)
    eos = eos_token_ids(loaded.model, loaded.tokenizer) | stop_token_ids(profile, loaded.tokenizer)
    grammars = GrammarCompiler(loaded.tokenizer, eos)
    grammars.prepare()
    overlap = overlaps(config, loaded.device, speculation)
    log.info("steps overlap: %s (--overlap-steps %s)", "on" if overlap else "off", config.overlap_steps)
    engine = Engine(
        runner,
        loaded.tokenizer,
        eos_token_ids=eos,
        context_length=loaded.context_length,
        options=EngineOptions(
            max_running=limits.max_running,
            max_queue=config.max_queue,
            prefill_budget_tokens=limits.prefill_tokens,
            prefix_caching=config.prefix_caching,
            blocked_phrases=config.blocked_phrases,
            refusal_message=config.refusal_message,
            stream_interval=config.stream_interval,
            overlap=overlap,
            scheduling_policy=config.scheduling_policy,
        ),
        grammars=grammars,
        on_device_failure=on_device_failure,
        speculation=speculation,
    )
    engine.blocks.tier = tier
    engine.start()
    progress.advance(1.0)
    return ServingModel(
        loaded,
        engine,
        prompt_renderer(loaded, profile),
        grammars,
        limits.max_running,
        config.default_max_tokens,
        loras,
    )


def host_tier(config: WorkerConfig, runner: ModelRunner) -> HostTier | None:
    """``--kv-offload-bytes``'s host tier, its queued copies run before each of the runner's forwards
    (None: off; ``auto``: :func:`offload_bytes`). Refused for a hybrid model (its state checkpoints
    have no host copies yet)."""
    size = offload_bytes(config, runner)
    if not size:
        return None
    if getattr(runner, "states", None) is not None:
        raise ModelLoadError(
            "--kv-offload-bytes does not serve hybrid (recurrent-state) models yet: a prefix brought "
            "back from the host needs its recurrent state checkpoint, which has no host copy",
            param="kv_offload_bytes",
        )
    slots = size // (runner.kv_shape.bytes_per_token * runner.block_size)
    if slots < 1:
        raise ModelLoadError(f"--kv-offload-bytes {size} holds no KV block of this model")
    host = HostKV(runner.pool, slots)
    tier = HostTier(slots, host.block_bytes)
    runner.execute = tiered(runner.execute, tier, host.apply)  # type: ignore[method-assign]
    log.info(
        "KV host tier: %d blocks, %.2f GiB (--kv-offload-bytes)", slots, slots * host.block_bytes / 2**30
    )
    return tier


def offload_bytes(config: WorkerConfig, runner: ModelRunner) -> int:
    """``--kv-offload-bytes``, ``auto`` resolved and logged: on a CUDA device, off on the CPU (both
    tiers the same memory), with a hybrid model, tensor parallelism or --fake-tokens."""
    if config.kv_offload_bytes is not None:
        return config.kv_offload_bytes
    off = next(
        (
            why
            for why, applies in (
                ("--fake-tokens", config.fake_tokens),
                ("tensor parallel", config.tensor_parallel_size > 1),
                ("the CPU: both tiers would be the same memory", runner.device.type != "cuda"),
                ("a hybrid model", getattr(runner, "states", None) is not None),
            )
            if applies
        ),
        None,
    )
    size, why = auto_offload_bytes(off, None if off else available_host_bytes())
    log.info("KV host tier: --kv-offload-bytes auto: %s", why)
    return size


def served_loras(config: WorkerConfig, runner: ModelRunner, loaded: LoadedModel) -> LoraRegistry | None:
    """``--enable-lora``'s adapters (None without it); a ``--lora-modules`` folder refused stops
    the start naming it."""
    if runner.lora is None:
        return None
    try:
        return lora_registry(config, runner.lora.targets, loaded.model_id, loaded.dtype)
    except ValueError as exc:
        raise ModelLoadError(str(exc), param="lora_modules") from exc


def overlaps(config: WorkerConfig, device: torch.device, speculation: Speculation | None) -> bool:
    """Whether the engine's steps overlap (``--overlap-steps``; auto: on CUDA without speculation)."""
    if config.overlap_steps == "auto":
        return device.type == "cuda" and speculation is None
    return config.overlap_steps == "on"


def prompt_renderer(loaded: LoadedModel, profile: FamilyProfile) -> PromptRenderer:
    """The prompt renderer of a generation model (with its image processing, for a vision model)."""
    spec = vision_spec(loaded.model.config) if loaded.processor is not None else None
    images = ImageProcessing(loaded.processor, spec) if spec is not None else None
    return PromptRenderer(loaded.tokenizer, profile, images)


def serving_in_own_process(
    config: WorkerConfig,
    progress: LoadProgress | None = None,
    on_device_failure: Callable[[BaseException], None] | None = None,
) -> ServingModel:
    """``--engine-process``: :func:`build_serving` in the engine process; here, what serving needs
    of the model (its tokenizer, prompts, grammars) and the client of that process's engine."""
    progress = progress or LoadProgress()
    rules = TextRules.of(config)
    client, facts = start_engine_process(config, build_serving, progress, rules, on_device_failure)
    log.info("the engine runs in its own process (pid %s)", client.pid)
    return serving_of_engine(config, client, facts)


def serving_of_engine(config: WorkerConfig, client: EngineClient, facts: ModelFacts) -> ServingModel:
    """What a serving process needs of the model (its tokenizer, prompts, grammars) around the
    client of the engine process's engine."""
    loaded = facts.loaded
    profile = family_profile(config, loaded.model, loaded.tokenizer)
    grammars = GrammarCompiler(loaded.tokenizer, set(facts.eos_token_ids))
    grammars.prepare()
    return ServingModel(
        loaded,
        client,
        prompt_renderer(loaded, profile),
        grammars,
        facts.max_running,
        config.default_max_tokens,
    )


def speculation_of(config: WorkerConfig, loaded: LoadedModel) -> Speculation | None:
    """``--speculative``'s settings for the engine (None: off), loading the draft model for
    ``draft`` on the model's device and dtype; raises :class:`ModelLoadError` for a draft model
    that does not share the tokenizer or cannot load."""
    if config.speculative == "off":
        return None
    draft = None
    if config.speculative == "draft":
        drafting = load_model(
            config.draft_model,
            device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            cache_dir=config.cache_dir,
            quantization=draft_quantization(config.draft_quantization, loaded.device),
        )
        draft = DraftModel(drafting, loaded)
    return Speculation(
        config.num_speculative_tokens,
        config.ngram_min,
        config.ngram_max,
        config.speculative_rows,
        config.speculative_min_acceptance,
        draft,
    )


def draft_quantization(choice: str, device: torch.device) -> str:
    """``--draft-quantization``'s scheme on ``device``: ``auto`` is int4 on the CPU (its kernels
    make a small draft fast there) and none elsewhere (int4 off the CPU dequantizes per call)."""
    if choice != "auto":
        return choice
    return "int4" if device.type == "cpu" else "none"


# Inputs per pooling step when --max-running is not set (pooling rows hold no cache).
POOLING_MAX_ROWS = 32


def pooling_serving(
    config: WorkerConfig,
    loaded: LoadedModel,
    progress: LoadProgress,
    on_device_failure: Callable[[BaseException], None] | None,
) -> ServingModel:
    """``--task embed|score``: the pooling engine over the loaded model (no KV pool, no grammars)."""
    assert loaded.pooling is not None
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    runner = PoolingRunner(loaded.model, loaded.pooling, loaded.device, pad if isinstance(pad, int) else 0)
    rows = config.max_running or POOLING_MAX_ROWS
    engine = PoolingEngine(
        runner,
        max_rows=rows,
        max_queue=config.max_queue,
        budget_tokens=prefill_tokens(config, loaded.device),
        on_device_failure=on_device_failure,
    )
    engine.start()
    log.info(
        "task %s: %s pooling%s, up to %d inputs per step",
        loaded.task,
        loaded.pooling.mode if loaded.task == "embed" else "classifier",
        ", normalised" if loaded.pooling.normalize else "",
        rows,
    )
    progress.advance(1.0)
    profile = family_profile(config, loaded.model, loaded.tokenizer)
    return ServingModel(loaded, engine, PromptRenderer(loaded.tokenizer, profile), None, rows)


def metrics_text(serving: ServingModel | None, config: WorkerConfig) -> str | None:
    """The ``/metrics`` exposition (None while the model loads: a 503), from the stats the engine
    last published: on the event loop, so it never waits for the engine's lock or its process."""
    if serving is None:
        return None
    return metrics.render(
        serving.engine.latest_stats(),
        serving.loaded.model_id,
        metrics.MetricNames(config.metrics_names),
        fake_tokens=config.fake_tokens,
    )


async def run(config: WorkerConfig, *, metrics_socket: socket.socket | None = None) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit status (2: a port is taken, 1: the model
    did not load, 3: the device failed, or another serving process exited).
    ``metrics_socket``: the claimed /metrics socket (None: off)."""
    load_progress = LoadProgress()
    service = WorkerService(config.resolved_worker_id, load_progress)
    service.tracer = open_tracer(TRACE_SERVICE_NAME, config.otlp_traces_endpoint)
    grpc_server = GrpcServer(service, share_port=config.api_server_count > 1)
    server = grpc_server.server
    address = f"{config.host}:{config.port}"
    try:
        # Checked again (python -m worker checked it before importing torch): the gRPC
        # core's own bind error is a generic "Failed to bind" plus a C-level log line.
        check_port_free(config.host, config.port, "--port")
        server.add_insecure_port(address)
    except (PortUnavailableError, RuntimeError) as error:
        reason = (
            error.message if isinstance(error, PortUnavailableError) else f"--port {config.port}: {error}"
        )
        log.error("%s", reason)
        if metrics_socket is not None:
            metrics_socket.close()
        return EXIT_PORT_TAKEN
    await server.start()
    await grpc_server.set_serving(False)
    serving: ServingModel | None = None

    metrics_server = (
        None
        if metrics_socket is None
        else await metrics.serve_metrics(metrics_socket, lambda: metrics_text(serving, config))
    )
    metrics_where = f":{config.resolved_metrics_port}" if metrics_server is not None else "off"
    log.info(
        "worker %s listening on %s (metrics on %s); loading model", service.worker_id, address, metrics_where
    )
    log.info("per-token modules: %s", compiled.describe())

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    device_failed = asyncio.Event()

    failures: list[BaseException | str] = []

    def on_device_failure(failure: BaseException | str) -> None:  # the engine thread
        failures.append(failure)
        with contextlib.suppress(RuntimeError):  # the loop is gone: the process is ending anyway
            loop.call_soon_threadsafe(not_serving)

    going: list[asyncio.Task[None]] = []

    def not_serving() -> None:
        """Health NOT_SERVING in the loop's next turn, before any caller can hear of a failed request
        (those go out from that turn on) and ask again; then the worker exits (below)."""
        going.append(loop.create_task(grpc_server.set_serving(False)))
        device_failed.set()

    loading = asyncio.ensure_future(
        in_own_thread(
            functools.partial(
                serving_in_own_process if config.runs_engine_process else build_serving,
                progress=load_progress,
                on_device_failure=on_device_failure,
            ),
            config,
        )
    )
    stopper = asyncio.ensure_future(stop.wait())
    others: ServingProcesses | None = None
    try:
        await asyncio.wait({loading, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            log.info("stopped while loading the model")
            await server.stop(0)
            return 0
        try:
            serving = service.serving = loading.result()
            others = await _more_serving_processes(config, serving)
        except Exception as exc:  # ModelLoadError, ServingProcessError, or a failure outside the load
            failure = (
                exc
                if isinstance(exc, (ModelLoadError, ServingProcessError))
                else unexpected_load_error(exc, config.model)
            )
            log.error("%s", failure.message if isinstance(failure, ModelLoadError) else failure)
            await server.stop(0)
            if serving is not None:
                serving.engine.stop()
            return 1
        if others is not None:
            others.watch(loop, on_device_failure)  # another serving process's exit ends the worker
        freeze_startup_heap(log, "serving process")
        await grpc_server.set_serving(True)
        log.info("serving %s on %s (metrics on %s)", serving.loaded.model_id, address, metrics_where)

        failing = asyncio.ensure_future(device_failed.wait())
        await asyncio.wait({stopper, failing}, return_when=asyncio.FIRST_COMPLETED)
        failed = failing.done()
        if failed:
            first = failures[0] if failures else "unknown failure"
            log.error(
                "%s: NOT_SERVING, exiting with status %d to be restarted",
                first if isinstance(first, str) else f"the engine stopped ({first})",
                EXIT_ENGINE_FAILED,
            )
        failing.cancel()
        grace = 0.0 if failed else config.grace_period
        if others is not None:
            others.terminate()  # they drain alongside this one
        await grpc_server.drain(grace)
        await server.stop(0)
        if others is not None:
            await asyncio.to_thread(others.stop, grace)
        serving.engine.stop()
        if failed:
            return EXIT_ENGINE_FAILED
        log.info("worker stopped")
        return 0
    finally:
        if metrics_server is not None:
            metrics_server.close()
        if service.tracer is not None:
            await asyncio.to_thread(service.tracer.close)  # the spans still batched


async def _more_serving_processes(config: WorkerConfig, serving: ServingModel) -> ServingProcesses | None:
    """``--api-server-count`` above 1: the other serving processes, started and serving."""
    if config.api_server_count == 1:
        return None
    client = serving.engine
    assert isinstance(client, EngineClient)  # several serving processes imply the engine process
    others = await asyncio.to_thread(ServingProcesses.start, config, client, serving_of_engine)
    log.info("%d more serving processes on the port (pids %s)", len(others.pids), others.pids)
    return others


_T = TypeVar("_T")
_R = TypeVar("_R")


async def in_own_thread(fn: Callable[[_T], _R], arg: _T) -> _R:
    """``fn(arg)`` in a new thread that ends when it returns (not in asyncio's long-lived executor).

    The model loads this way so that once serving starts the engine thread is the only thread
    with an OpenMP team. libgomp keeps a team's threads for as long as the thread that started it
    lives, and when a process has more OpenMP threads than cores, its threads stop spinning
    between parallel regions and sleep instead: every operator of a decode step then pays a
    wake-up. With the loader's team kept alive, a 16-row decode step of the default model took
    about 1.4x as long (docs/benchmarks.md).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_R] = loop.create_future()

    def settle(result: _R | None, error: BaseException | None) -> None:
        if future.done():  # the caller stopped waiting (shutdown while loading)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            outcome: tuple[_R | None, BaseException | None] = (fn(arg), None)
        except BaseException as exc:  # handed to the awaiting task, which decides
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody is waiting
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="sluice-loader", daemon=True).start()
    return await future
