"""The sluice.v1.Worker gRPC service: thin translation between the wire and the engine.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from sluice.logs import request_id_var
from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from worker.engine.core import Engine
from worker.engine.prepare import Prepared
from worker.errors import GenerationFailed, InvalidRequest, ModelLoading, WorkerError
from worker.model.load_progress import LoadProgress, wait_for_load
from worker.model.loader import LoadedModel
from worker.output.formats.registry import thinking_open_marker
from worker.sampling.grammar import GrammarCompiler
from worker.service.convert import (
    MAX_N,
    ParsedRequest,
    check_resumed_tokens,
    event_to_proto,
    parse_request,
    sampling_options,
)
from worker.service.prompt import PromptRenderer
from worker.types import Failed, Finished, GenerationRequest, OutputOptions, Progress

# Template rendering, tokenization and grammar compilation of a large request take long enough to
# stall every other stream's events if they ran on the event loop; they run in these threads.
PREPARE_THREADS = 2

log = logging.getLogger(__name__)


@dataclass
class ServingModel:
    """What the service needs once the model is loaded."""

    loaded: LoadedModel
    engine: Engine
    renderer: PromptRenderer
    grammars: GrammarCompiler
    max_running: int
    default_max_tokens: int | None = None


class WorkerService(pb_grpc.WorkerServicer):
    """Generate and ListModels. ``serving`` is None until the model is loaded; meanwhile calls get
    UNAVAILABLE ``model_loading`` with ``load_progress``'s fraction, or, when a Generate request
    asks to wait (``model_load_wait_seconds``), MODEL_LOAD progress events until it is loaded."""

    def __init__(self, worker_id: str, load_progress: LoadProgress | None = None):
        self.worker_id = worker_id
        self.serving: ServingModel | None = None
        self.load_progress = load_progress or LoadProgress()
        self._prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="sluice-prepare")

    def _require_serving(self) -> ServingModel:
        if self.serving is None:
            raise ModelLoading(
                "the worker is still loading its model; retry shortly",
                load_fraction=self.load_progress.fraction,
                retry_after_seconds=5.0,
            )
        return self.serving

    async def _wait_for_load(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """While the model loads and the request asks to wait: its MODEL_LOAD progress events
        (when it asked for progress), up to ``model_load_wait_seconds``; returns at once when
        the model is loaded or the request does not wait. Raises :class:`InvalidRequest` for a
        negative or non-finite wait."""
        wait_s = request.model_load_wait_seconds
        if not math.isfinite(wait_s) or wait_s < 0:
            raise InvalidRequest(
                f"model_load_wait_seconds must be a finite number >= 0, got {wait_s}",
                param="model_load_wait_seconds",
            )
        if self.serving is not None or wait_s == 0:
            return
        log.info("request %s waits up to %g s for the model load", request_id_var.get(), wait_s)
        async for fraction in wait_for_load(self.load_progress, lambda: self.serving is not None, wait_s):
            if request.stream_progress:
                yield pb.GenerateResponse(
                    progress=pb.Progress(stage=pb.Progress.MODEL_LOAD, fraction=fraction)
                )

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        try:
            serving = self._require_serving()
        except WorkerError as exc:
            await context.abort_with_status(exc.to_status())
            raise  # unreachable: abort_with_status raises
        loaded, profile = serving.loaded, serving.renderer.profile
        formats = pb.ChatFormats(
            family=profile.family,
            tool_call_parser=profile.tool_parser,
            reasoning_parser=profile.reasoning_parser or "",
            thinking_switch=profile.thinking_switch,
        )
        info = pb.ModelInfo(
            id=loaded.model_id,
            created=int(loaded.loaded_at),
            owned_by="sluice",
            context_length=loaded.context_length,
            source=loaded.source,
            chat_formats=formats,
        )
        return pb.ListModelsResponse(models=[info], worker_id=self.worker_id)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.monotonic()
        request_id = request.request_id or _metadata_request_id(context) or uuid.uuid4().hex
        # grpc.aio runs each call in its own task, so this binds the id for this call only.
        request_id_var.set(request_id)
        try:
            loading = self.serving is None
            async for load_event in self._wait_for_load(request):
                yield load_event
            if loading and self.serving is not None:
                arrival = time.monotonic()  # queue time starts once the model is there
            serving = self._require_serving()
            parsed = parse_request(request, serving.loaded.model_id)
            # In the caller's context, so the prepare thread's log lines carry the request id.
            prepare = functools.partial(
                contextvars.copy_context().run, _prepare, serving, parsed, request_id, arrival
            )
            prepared = await asyncio.get_running_loop().run_in_executor(self._prepare_pool, prepare)
            stream = serving.engine.submit(prepared.work)
        except WorkerError as exc:
            log.info("request %s rejected: %s (%s)", request_id, exc.message, exc.code.name)
            await context.abort_with_status(exc.to_status())
            return
        prompt_ids, prompt_text, options = (
            prepared.prompt_ids,
            prepared.prompt_text,
            prepared.work.request.sampling,
        )
        log.info(
            "request %s accepted: %d prompt tokens, n=%d, max_tokens=%d%s",
            request_id,
            len(prompt_ids),
            options.n,
            options.max_tokens,
            f", resuming after {len(parsed.resumed_token_ids)} tokens" if parsed.resumed_token_ids else "",
        )
        reasons: list[str] = []
        completion_tokens = 0
        outcome = "cancelled by the caller"  # unless the stream ends or fails below
        try:
            yield pb.GenerateResponse(
                started=pb.Started(
                    request_id=request_id,
                    model=serving.loaded.model_id,
                    prompt_tokens=len(prompt_ids),
                    worker_id=self.worker_id,
                    prompt_text=prompt_text if parsed.echo_prompt else "",
                    n=options.n,
                    resumable=True,
                )
            )
            async for event in stream:
                if isinstance(event, Failed):
                    outcome = "failed"
                    log.error("request %s: generation failed: %s", request_id, event.message)
                    if event.usage is not None:
                        yield event_to_proto(event.usage)  # the partial usage, before the status
                    await context.abort_with_status(GenerationFailed(event.message).to_status())
                    return
                if isinstance(event, Finished):
                    reasons.append(event.reason.value)
                    completion_tokens += event.completion_tokens
                if isinstance(event, Progress) and not request.stream_progress:
                    continue  # the caller did not ask for progress events
                try:
                    message = event_to_proto(event)
                except Exception as error:  # this request's output cannot be sent: it alone fails
                    log.exception("request %s: converting %s failed", request_id, type(event).__name__)
                    outcome = "failed"
                    await context.abort_with_status(
                        GenerationFailed(f"output conversion failed: {type(error).__name__}").to_status()
                    )
                    return
                yield message
            outcome = "completed"
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as error:
            if outcome != "failed":  # abort_with_status raises after a Failed event
                outcome = f"failed ({error.__class__.__name__})"
            raise
        finally:
            # Reached on normal end, on failure and when the caller cancels (the
            # task is cancelled): in every case the engine drops the sequence.
            stream.cancel()
            log.info(
                "request %s %s: finish_reasons=%s, completion_tokens=%d, %.3f s",
                request_id,
                outcome,
                ",".join(reasons) or "-",
                completion_tokens,
                time.monotonic() - arrival,
            )


@dataclass(frozen=True)
class _PreparedCall:
    work: Prepared
    prompt_ids: tuple[int, ...]
    prompt_text: str


def _prepare(serving: ServingModel, parsed: ParsedRequest, request_id: str, arrival: float) -> _PreparedCall:
    """Everything blocking before a request can be queued: the chat template, tokenization, option
    checks that need the prompt's length, grammar compilation. Runs in the prepare threads."""
    prompt_ids, prompt_text = serving.renderer.render(parsed.prompt)
    options = sampling_options(
        parsed.sampling,
        prompt_tokens=len(prompt_ids),
        context_length=serving.loaded.context_length,
        vocab_size=serving.renderer.vocab_size,
        max_n=min(MAX_N, serving.max_running),
        default_max_tokens=serving.default_max_tokens,
    )
    check_resumed_tokens(parsed.resumed_token_ids, serving.renderer.vocab_size)
    profile = serving.renderer.profile
    spec = parsed.grammar
    if spec is not None and spec.kind == "tool_call":
        spec = dataclasses.replace(spec, call_format=profile.call_grammar)  # the family's own format
    grammar = serving.grammars.validate(spec) if spec is not None else None
    reasoning = profile.reasoning_parser or "qwen3"
    opened = thinking_open_marker(reasoning)
    tool_calls = parsed.parse_tool_calls and profile.tool_parser != "none"
    output = OutputOptions(
        tool_calls=tool_calls,
        reasoning=serving.renderer.thinks,
        keep_reasoning=parsed.enable_thinking is not False,
        starts_thinking=bool(opened) and prompt_text.rstrip().endswith(opened),
        tool_parser=profile.tool_parser,
        reasoning_parser=reasoning,
        # The markers are needed where a parser reads them; other text keeps skipping special tokens.
        keep_special_tokens=profile.keep_special_tokens and (tool_calls or serving.renderer.thinks),
    )
    request = GenerationRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=options,
        arrival_time=arrival,
        return_token_ids=parsed.return_token_ids,
        output=output,
        grammar=grammar,
        resumed_token_ids=parsed.resumed_token_ids,
    )
    return _PreparedCall(serving.engine.prepare(request), prompt_ids, prompt_text)


def _metadata_request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str):
            return value
    return ""
