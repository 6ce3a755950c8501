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
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from sluice.limits import MAX_N
from sluice.logs import request_id_var
from sluice.tracing import Tracer
from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from worker.engine.core import Engine
from worker.engine.pooling import PoolingEngine
from worker.engine.prepare import Prepared
from worker.engine.process import EngineClient
from worker.errors import GenerationFailed, InvalidRequest, LoraNotEnabled, ModelLoading, WorkerError
from worker.formats.registry import thinking_open_marker
from worker.lora.registry import LoraRegistry
from worker.model.load_progress import LoadProgress, wait_for_load
from worker.model.loader import LoadedModel
from worker.prompts.prompt import ChatPrompt, PromptRenderer
from worker.sampling.grammar import GrammarCompiler
from worker.service import tracing
from worker.service.convert import (
    ParsedRequest,
    TokenizeCall,
    check_resumed_tokens,
    event_to_proto,
    parse_detokenize_request,
    parse_request,
    parse_tokenize_request,
    sampling_options,
    truncated_prompt,
)
from worker.service.pooling import (
    PoolingWork,
    check_task,
    embed_response,
    prepare_embed,
    prepare_score,
    score_response,
)
from worker.service.streams import Events, Sink, relayed, serve_streams
from worker.service.thinking import thinking_budget, with_effort
from worker.types import Event, Failed, Finished, GenerationRequest, OutputOptions, Progress

# Template rendering, tokenization and grammar compilation of a large request take long enough to
# stall every other stream's events if they ran on the event loop; they run in these threads.
PREPARE_THREADS = 2
T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass
class ServingModel:
    """What the service needs once the model is loaded: a generation engine and grammars for
    ``--task generate``, a pooling engine (and no grammars) for ``embed`` and ``score``."""

    loaded: LoadedModel
    engine: Engine | EngineClient | PoolingEngine
    renderer: PromptRenderer
    grammars: GrammarCompiler | None
    max_running: int
    default_max_tokens: int | None = None
    loras: LoraRegistry | None = None  # --enable-lora's adapters

    def adapter_named(self, model: str) -> str:
        """The LoRA adapter a request's ``model`` names; "" for the base model's name, none, or a
        name served by neither (which the request's parsing then refuses as not found)."""
        if not model or model == self.loaded.model_id or self.loras is None or not self.loras.knows(model):
            return ""
        return model

    @property
    def max_n(self) -> int:
        """The most choices one request may ask for here (``ModelInfo.max_n``): each takes a slot."""
        return min(MAX_N, self.max_running)

    @property
    def generator(self) -> Engine | EngineClient:
        """The generation engine; raises :class:`~worker.errors.WrongTask` on a pooling worker."""
        check_task(self.loaded, "Generate", "")
        assert isinstance(self.engine, Engine | EngineClient)
        return self.engine

    @property
    def pooler(self) -> PoolingEngine:
        assert isinstance(self.engine, PoolingEngine)  # check_task ran first
        return self.engine


_Request = TypeVar("_Request", pb.EmbedRequest, pb.ScoreRequest)
_Reply = TypeVar("_Reply", pb.EmbedResponse, pb.ScoreResponse)


class WorkerService(pb_grpc.WorkerServicer):
    """Generate, ListModels, Tokenize and Detokenize (these two in the prepare threads, never
    through the engine). ``serving`` is None until the model is loaded; meanwhile calls get
    UNAVAILABLE ``model_loading`` with ``load_progress``'s fraction, or, when a Generate request
    asks to wait (``model_load_wait_seconds``), MODEL_LOAD progress events until it is loaded."""

    def __init__(self, worker_id: str, load_progress: LoadProgress | None = None):
        self.worker_id = worker_id
        self.serving: ServingModel | None = None
        self.load_progress = load_progress or LoadProgress()
        self.tracer: Tracer | None = None  # --otlp-traces-endpoint (worker/service/tracing.py)
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
            task=loaded.task,
            accepts_images=serving.renderer.accepts_images,
            max_n=serving.max_n if loaded.task == "generate" else 0,
        )
        adapters = [
            _adapter_info(info, name, path) for name, path in (serving.loras.names() if serving.loras else ())
        ]
        return pb.ListModelsResponse(
            models=[info, *adapters], worker_id=self.worker_id, generate_streams=True
        )

    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterResponse:
        try:
            loras = _loras(self._require_serving())
            name, path = request.lora_name, request.lora_path
            await self._in_thread(loras.load, name, path, request.base_model_name or None)
        except WorkerError as exc:
            log.info("LoRA adapter %r not loaded: %s", request.lora_name, exc.message)
            await context.abort_with_status(exc.to_status())
            raise  # unreachable: abort_with_status raises
        log.info("LoRA adapter %r loaded from %s", name, path)
        return pb.LoraAdapterResponse(lora_name=name, worker_id=self.worker_id)

    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterResponse:
        try:
            _loras(self._require_serving()).unload(request.lora_name)
        except WorkerError as exc:
            await context.abort_with_status(exc.to_status())
            raise  # unreachable: abort_with_status raises
        log.info("LoRA adapter %r unloaded", request.lora_name)
        return pb.LoraAdapterResponse(lora_name=request.lora_name, worker_id=self.worker_id)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            serving = self._require_serving()
            call = parse_tokenize_request(
                request, serving.adapter_named(request.model) or serving.loaded.model_id
            )
            ids, strings = await self._in_thread(_tokenize, serving, call)
        except WorkerError as exc:
            await context.abort_with_status(exc.to_status())
            raise  # unreachable: abort_with_status raises
        return pb.TokenizeResponse(
            ids=ids,
            count=len(ids),
            max_model_len=serving.loaded.context_length,
            token_strs=strings,
            model=serving.loaded.model_id,
            worker_id=self.worker_id,
        )

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        try:
            serving = self._require_serving()
            ids = parse_detokenize_request(
                request, serving.adapter_named(request.model) or serving.loaded.model_id
            )
            skip = request.skip_special_tokens
            text = await self._in_thread(lambda: serving.renderer.decode(ids, skip_special_tokens=skip))
        except WorkerError as exc:
            await context.abort_with_status(exc.to_status())
            raise  # unreachable: abort_with_status raises
        return pb.DetokenizeResponse(text=text, model=serving.loaded.model_id, worker_id=self.worker_id)

    async def _in_thread(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` in a prepare thread, in the caller's context (so the thread's log
        lines carry the request id)."""
        run = functools.partial(contextvars.copy_context().run, function, *args)
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, run)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        events = self.generate_events(
            request, tuple(context.invocation_metadata() or ()), context.time_remaining
        )
        async for event in relayed(events, context):
            yield event

    async def GenerateStreams(
        self, request_iterator: AsyncIterator[pb.StreamsRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await serve_streams(context, self.stream_events)

    def stream_events(
        self, opened: pb.OpenStream, remaining: Callable[[], float | None], sink: Sink
    ) -> Events:
        """The events of one stream of ``GenerateStreams`` (see :meth:`generate_events`)."""
        return self.generate_events(opened.request, tuple(opened.metadata.items()), remaining, sink)

    async def generate_events(
        self,
        request: pb.GenerateRequest,
        metadata: Sequence[tuple[str, str | bytes]],
        remaining: Callable[[], float | None],
        sink: Sink | None = None,
    ) -> Events:
        """One ``Generate`` request's events, for ``Generate`` and each stream of
        ``GenerateStreams`` alike; a failure is raised as the :class:`WorkerError` whose status ends
        the call (after the events sent before it). ``metadata`` is the call's (request id, trace
        parent); ``remaining`` says the seconds left before its deadline (None: none). With a
        ``sink``, the generated events go to it as each step delivers them, and only those before
        them (load progress, ``started``) are yielded."""
        arrival = time.monotonic()
        request_id = request.request_id or _metadata_request_id(metadata) or uuid.uuid4().hex
        # Each call (and each stream) runs in its own task, so this binds the id for it only.
        request_id_var.set(request_id)
        try:
            loading = self.serving is None
            async for load_event in self._wait_for_load(request):
                yield load_event
            if loading and self.serving is not None:
                arrival = time.monotonic()  # queue time starts once the model is there
            serving = self._require_serving()
            adapter = serving.adapter_named(request.model)
            left = remaining()
            deadline = None if left is None else time.monotonic() + left
            parsed = parse_request(request, adapter or serving.loaded.model_id, deadline)
            engine = serving.generator  # first: a pooling worker refuses naming its task
            prepared = await self._in_thread(_prepare, serving, parsed, request_id, arrival, adapter)
            stream = await engine.queue(prepared.work)
        except WorkerError as exc:
            log.info("request %s rejected: %s (%s)", request_id, exc.message, exc.code.name)
            raise
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
        trace = tracing.begin(self.tracer, metadata, request, request_id, arrival)
        if trace is not None:
            trace.model, trace.sampling = adapter or serving.loaded.model_id, options
        try:
            yield pb.GenerateResponse(
                started=pb.Started(
                    request_id=request_id,
                    model=adapter or serving.loaded.model_id,
                    prompt_tokens=len(prompt_ids),
                    worker_id=self.worker_id,
                    prompt_text=prompt_text if parsed.echo_prompt else "",
                    n=options.n,
                    resumable=True,
                )
            )

            def send(event: Event, emit: Callable[[pb.GenerateResponse], None]) -> None:
                """One event to the caller (a Failed one, or one that cannot be converted, raises)."""
                nonlocal outcome, completion_tokens
                if trace is not None:
                    trace.observe(event)
                if isinstance(event, Failed):
                    outcome = "failed"
                    log.error("request %s: generation failed: %s", request_id, event.message)
                    if event.usage is not None:
                        emit(event_to_proto(event.usage))  # the partial usage, before the status
                    raise GenerationFailed(event.message)
                if isinstance(event, Finished):
                    reasons.append(event.reason.value)
                    completion_tokens += event.completion_tokens
                if isinstance(event, Progress) and not request.stream_progress:
                    return  # the caller did not ask for progress events
                try:
                    message = event_to_proto(event)
                except Exception as error:  # this request's output cannot be sent: it alone fails
                    log.exception("request %s: converting %s failed", request_id, type(event).__name__)
                    outcome = "failed"
                    raise GenerationFailed(f"output conversion failed: {type(error).__name__}") from error
                emit(message)

            if sink is not None:

                def push(events: list[Event]) -> None:
                    for event in events:
                        send(event, sink)

                await stream.pushed(push)
            else:
                async for event in stream:
                    messages: list[pb.GenerateResponse] = []
                    try:
                        send(event, messages.append)
                    except GenerationFailed:
                        for message in messages:  # a Failed event's usage goes before its status
                            yield message
                        raise
                    for message in messages:
                        yield message
            outcome = "completed"
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as error:
            if outcome != "failed":  # a Failed event or a conversion error raised above
                outcome = f"failed ({error.__class__.__name__})"
            raise
        finally:
            # Reached on normal end, on failure and when the caller cancels (the
            # task is cancelled): in every case the engine drops the sequence.
            stream.cancel()
            if trace is not None:
                trace.end(outcome)
            log.info(
                "request %s %s: finish_reasons=%s, completion_tokens=%d, %.3f s",
                request_id,
                outcome,
                ",".join(reasons) or "-",
                completion_tokens,
                time.monotonic() - arrival,
            )

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        return await self._pooled("Embed", request, context, prepare_embed, embed_response)

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        return await self._pooled("Score", request, context, prepare_score, score_response)

    async def _pooled(
        self,
        call: str,
        request: _Request,
        context: grpc.aio.ServicerContext,
        prepare: Callable[[LoadedModel, _Request], PoolingWork],
        respond: Callable[[LoadedModel, PoolingWork, torch.Tensor, str], _Reply],
    ) -> _Reply:
        """One Embed or Score call: checked and tokenized in the prepare threads, batched by the
        pooling engine with the other calls, answered in one message."""
        arrival = time.monotonic()
        request_id = (
            request.request_id
            or _metadata_request_id(tuple(context.invocation_metadata() or ()))
            or uuid.uuid4().hex
        )
        request_id_var.set(request_id)
        try:
            serving = self._require_serving()
            check_task(serving.loaded, call, request.model)
            work = await asyncio.get_running_loop().run_in_executor(
                self._prepare_pool,
                functools.partial(contextvars.copy_context().run, prepare, serving.loaded, request),
            )
            rows = await serving.pooler.submit(request_id, work.inputs)
            reply = respond(serving.loaded, work, rows, self.worker_id)
        except WorkerError as exc:
            log.info("%s %s rejected: %s (%s)", call, request_id, exc.message, exc.code.name)
            await context.abort_with_status(exc.to_status())
            raise  # unreachable: abort_with_status raises
        log.info(
            "%s %s completed: %d inputs, %d tokens, %.3f s",
            call,
            request_id,
            len(work.inputs),
            work.prompt_tokens,
            time.monotonic() - arrival,
        )
        return reply


@dataclass(frozen=True)
class _PreparedCall:
    work: Prepared
    prompt_ids: tuple[int, ...]
    prompt_text: str


def _tokenize(serving: ServingModel, call: TokenizeCall) -> tuple[tuple[int, ...], list[str]]:
    """The prompt's ids rendered as Generate renders it, and their strings when asked."""
    ids, _ = serving.renderer.render(
        call.prompt,
        add_special_tokens=call.add_special_tokens,
        add_generation_prompt=call.add_generation_prompt,
    )
    return ids, serving.renderer.token_strings(ids) if call.return_token_strs else []


def _prepare(
    serving: ServingModel, parsed: ParsedRequest, request_id: str, arrival: float, adapter: str = ""
) -> _PreparedCall:
    """Everything blocking before a request can be queued: the chat template, tokenization, option
    checks that need the prompt's length, grammar compilation, the LoRA ``adapter`` read in when
    it left host memory. Runs in the prepare threads."""
    profile = serving.renderer.profile
    prompt = with_effort(parsed.prompt, parsed.reasoning_effort, profile.thinking_switch)
    prompt_ids, prompt_text, images = serving.renderer.render_with_images(prompt)
    kept = truncated_prompt(parsed.sampling, prompt_ids, serving.loaded.context_length)
    if images and len(kept) < len(prompt_ids):
        raise InvalidRequest(
            "truncate_prompt_tokens would cut a prompt with images; send fewer messages instead",
            param="truncate_prompt_tokens",
        )
    if images and parsed.sampling.HasField("prompt_logprobs"):
        raise InvalidRequest("prompt_logprobs cannot score a prompt with images yet", param="prompt_logprobs")
    if len(kept) < len(prompt_ids):
        prompt_ids, prompt_text = kept, serving.renderer.decode(kept)
    options = sampling_options(
        parsed.sampling,
        prompt_tokens=len(prompt_ids),
        context_length=serving.loaded.context_length,
        vocab_size=serving.renderer.vocab_size,
        max_n=serving.max_n,
        default_max_tokens=serving.default_max_tokens,
        encode=serving.renderer.encode,
    )
    check_resumed_tokens(parsed.resumed_token_ids, serving.renderer.vocab_size)
    spec = parsed.grammar
    if spec is not None and spec.kind == "tool_call":
        spec = dataclasses.replace(spec, call_format=profile.call_grammar)  # the family's own format
    grammars = serving.grammars
    assert grammars is not None  # a generation worker has its grammars
    grammar = grammars.validate(spec) if spec is not None else None
    reasoning = profile.reasoning_parser or "qwen3"
    opened = thinking_open_marker(reasoning)
    tool_calls = parsed.parse_tool_calls and profile.tool_parser != "none"
    output = OutputOptions(
        tool_calls=tool_calls,
        # A raw prompt (completions) is text the caller laid out: its output is text, as in vLLM.
        reasoning=serving.renderer.thinks and isinstance(parsed.prompt, ChatPrompt),
        keep_reasoning=parsed.enable_thinking is not False,
        # A grammar constrains the output from its first token, so no thinking comes before it: what
        # it forces is the answer even where the prompt opened a thinking block (Qwen3.5's does).
        starts_thinking=bool(opened) and grammar is None and prompt_text.rstrip().endswith(opened),
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
        images=images,
        lora=serving.loras.resolve(adapter) if adapter and serving.loras is not None else None,
        scheduling=parsed.scheduling,
        stream_interval_s=parsed.stream_interval_s,
        # Thinking is parsed (a chat, a model that thinks, no grammar from the first token) and capped.
        thinking_budget=thinking_budget(
            parsed.thinking_token_budget,
            parsed.reasoning_effort,
            switch=profile.thinking_switch,
            reasoning_parser=reasoning,
            starts_thinking=output.starts_thinking,
            encode=serving.renderer.encode,
        )
        if output.reasoning and grammar is None
        else None,
    )
    return _PreparedCall(serving.generator.prepare(request), prompt_ids, prompt_text)


def _loras(serving: ServingModel) -> LoraRegistry:
    """The worker's adapters; raises :class:`LoraNotEnabled` on a worker started without them."""
    if serving.loras is None:
        raise LoraNotEnabled(
            "this worker serves no LoRA adapters; start it with --enable-lora", param="lora_name"
        )
    return serving.loras


def _adapter_info(base: pb.ModelInfo, name: str, path: str) -> pb.ModelInfo:
    """An adapter's ``ModelInfo``: its base model's, under its own name, with ``parent`` set."""
    info = pb.ModelInfo()
    info.CopyFrom(base)
    info.id, info.parent, info.source = name, base.id, path
    return info


def _metadata_request_id(metadata: Sequence[tuple[str, str | bytes]]) -> str:
    for key, value in metadata:
        if key == "x-request-id" and isinstance(value, str):
            return value
    return ""
