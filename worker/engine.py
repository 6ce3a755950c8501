"""The step loop that owns the model, and the async facade the service uses.

One daemon thread runs steps forever: apply aborts → schedule → execute →
update. Between steps requests join (``submit``) and leave (finish or
``abort``); an aborted request is removed before the next step whether it is
queued or running, and its caches are dropped with it.

The gRPC layer never blocks this thread: each request gets a
:class:`RequestStream` with an asyncio queue; once per step the thread hands
every request's events over with a single ``call_soon_threadsafe`` per event
loop, so a request sees its events in batches as the step produces them.

Before its first token a request hears ``Progress`` events: ``queued`` when it
is submitted and again every :data:`QUEUED_PROGRESS_INTERVAL_S` while it waits
for a slot, ``prompt_processing`` when its prefill starts. They tell a caller
with an idle timeout that the request is alive (the service forwards them
only to calls that set ``stream_progress``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from sluice.prometheus import Histogram
from worker.detokenizer import IncrementalDetokenizer, TokenTexts
from worker.grammar import GrammarCompiler, TokenConstraint
from worker.model_runner import ModelRunner
from worker.output_parser import ChoiceOutput
from worker.sampler import SequenceSampler, blocked_ids, choose_batch
from worker.scheduler import Scheduler, StepPlan
from worker.stop_strings import StopStringMatcher
from worker.types import (
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    Progress,
    RefusalDelta,
    Timings,
    TokenLogprob,
    Usage,
)

log = logging.getLogger(__name__)

_END = object()  # marks the end of a request's events
# A request still waiting for a slot hears ``queued`` again this often, so a caller's idle
# timer (the edge's --idle-timeout) does not mistake a long queue for a dead worker.
QUEUED_PROGRESS_INTERVAL_S = 2.0


@dataclass
class EngineCounters:
    """Monotonic counters, read by metrics and by tests through the metrics endpoint."""

    requests_submitted: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    steps: int = 0
    time_to_first_token: Histogram = field(default_factory=Histogram)


@dataclass(frozen=True)
class EngineStats:
    waiting_requests: int
    running_requests: int
    running_sequences: int
    live_caches: int
    cache_tokens: int
    cache_bytes: int
    reserved_tokens: int
    counters: EngineCounters


@dataclass
class _Choice:
    key: tuple[str, int]  # the runner's row key
    index: int
    sampler: SequenceSampler
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    output: ChoiceOutput
    last_token: int = 0
    generated: int = 0
    finished: bool = False
    reasoning_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _RequestState:
    key: str
    request: GenerationRequest
    choices: list[_Choice]
    stream: RequestStream
    admitted_time: float | None = None
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    progress_time: float = 0.0  # when the last ``queued`` progress event went out

    @property
    def request_id(self) -> str:
        return self.key

    @property
    def num_sequences(self) -> int:
        return len(self.choices)

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def reserved_tokens(self) -> int:
        return (self.prompt_length + self.request.sampling.max_tokens) * len(self.choices)

    @property
    def done(self) -> bool:
        return all(choice.finished for choice in self.choices)

    @property
    def row_keys(self) -> list[tuple[str, int]]:
        return [choice.key for choice in self.choices]


class RequestStream:
    """The events of one submitted request, as an async iterator.

    Iterate it once. Stopping early (``cancel()``, a cancelled task, or closing
    the iterator) aborts the request in the engine.
    """

    def __init__(self, engine: Engine, key: str, loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self.key = key
        self._loop = loop
        self._queue: asyncio.Queue[list[Any]] = asyncio.Queue()
        self._finished = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def put(self, batch: list[Any]) -> None:
        """Runs on the stream's event loop (see :func:`_deliver`)."""
        self._queue.put_nowait(batch)

    def cancel(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine.abort(self.key)

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while not self._finished:
                for item in await self._queue.get():
                    if item is _END:
                        self._finished = True
                        return
                    yield item
        finally:
            self.cancel()


def _deliver(batches: list[tuple[RequestStream, list[Any]]]) -> None:
    """Hands a step's event batches to their streams, waking each event loop once per step (not once
    per request). Called from the engine thread."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, list[Any]]]] = {}
    for stream, batch in batches:
        by_loop.setdefault(stream.loop, []).append((stream, batch))
    for loop, items in by_loop.items():
        # A closed loop means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[RequestStream, list[Any]]]) -> None:
    for stream, batch in items:
        stream.put(batch)


class Engine:
    """Continuous batching over one model. Thread-safe ``submit``/``abort``; ``start`` once."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        *,
        eos_token_ids: Iterable[int],
        context_length: int,
        max_running: int = 16,
        max_queue: int = 256,
        prefill_budget_tokens: int = 1024,
        max_batch_tokens: int | None = None,
        blocked_phrases: tuple[str, ...] = (),
        refusal_message: str = "I can't help with that.",
        grammars: GrammarCompiler | None = None,
    ):
        self._runner = runner
        self._tokenizer = tokenizer
        self._token_texts = TokenTexts(tokenizer)
        self._eos = frozenset(eos_token_ids)
        self._context_length = context_length
        # Worker-wide content rule: a blocked phrase ends the choice with a refusal and "content_filter".
        self._blocked_phrases = tuple(blocked_phrases)
        self._refusal_message = refusal_message
        self._grammars = grammars
        self._scheduler: Scheduler[_RequestState] = Scheduler(
            max_running,
            max_queue,
            prefill_budget_tokens,
            max_batch_tokens or max_running * context_length,
            prefill_cost=self._prefill_cost,
        )
        self._cv = threading.Condition()
        self._aborts: list[str] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="sluice-engine", daemon=True)
        self._ids = itertools.count()
        self.counters = EngineCounters()

    def _prefill_cost(self, state: _RequestState) -> int:
        """The prompt tokens a request's prefill computes: those the prefix cache does not hold
        (what the scheduler's per-step prefill budget counts)."""
        prompt = state.request.prompt_token_ids
        return len(prompt) - self._runner.prefix_cache.cached_length(prompt)

    # ------------------------------------------------------------ control

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queues a request; raises QueueFull at once when the queue is at its bound."""
        loop = asyncio.get_running_loop()
        key = f"{request.request_id}#{next(self._ids)}"
        stream = RequestStream(self, key, loop)
        state = _RequestState(
            key, request, self._new_choices(key, request), stream, progress_time=time.monotonic()
        )
        # On the stream's own loop (we are on it): "queued" comes before anything the step loop sends.
        stream.put([Progress("queued", 0.0)])
        with self._cv:
            self._scheduler.add(state)
            self.counters.requests_submitted += 1
            self.counters.prompt_tokens += len(request.prompt_token_ids)
            self._cv.notify_all()
        return stream

    def abort(self, key: str) -> None:
        with self._cv:
            self._aborts.append(key)
            self._cv.notify_all()

    def stats(self) -> EngineStats:
        with self._cv:
            running = list(self._scheduler.running)
            return EngineStats(
                waiting_requests=len(self._scheduler.waiting),
                running_requests=len(running),
                running_sequences=sum(r.num_sequences for r in running),
                live_caches=self._runner.live_rows,
                cache_tokens=self._runner.cache_tokens,
                cache_bytes=self._runner.cache_bytes,
                reserved_tokens=self._scheduler.reserved_tokens,
                counters=replace(self.counters, time_to_first_token=self.counters.time_to_first_token.copy()),
            )

    # --------------------------------------------------------------- loop

    def _new_choices(self, key: str, request: GenerationRequest) -> list[_Choice]:
        opts = request.sampling
        blocked = blocked_ids(self._eos, opts)
        return [
            _Choice(
                key=(key, i),
                index=i,
                sampler=SequenceSampler(
                    opts,
                    request.prompt_token_ids,
                    blocked,
                    seed_offset=i,
                    constraint=self._constraint(request),
                ),
                detokenizer=IncrementalDetokenizer(self._tokenizer, request.prompt_token_ids),
                stops=StopStringMatcher(opts.stop + self._blocked_phrases),
                output=ChoiceOutput(i, request.output),
            )
            for i in range(opts.n)
        ]

    def _constraint(self, request: GenerationRequest) -> TokenConstraint | None:
        if request.grammar is None:
            return None
        if self._grammars is None:
            raise RuntimeError("a grammar-constrained request reached an engine without a grammar compiler")
        return self._grammars.constraint(request.grammar)

    def _loop(self) -> None:
        while True:
            try:
                scheduled = self._next_plan()
            except Exception as exc:  # a scheduling bug must not kill the loop and hang every caller
                log.exception("engine scheduling failed")
                with self._cv:
                    everyone = [*self._scheduler.waiting, *self._scheduler.running]
                self._fail(everyone, f"generation failed: {type(exc).__name__}")
                continue
            if scheduled is None:
                return
            plan, still_queued = scheduled
            if still_queued:
                _deliver([(state.stream, [Progress("queued", 0.0)]) for state in still_queued])
            if plan.empty:
                continue
            try:
                self._step(plan)
            except Exception as exc:  # a model failure must not kill the loop
                log.exception("engine step failed")
                self._fail(plan.prefill + plan.decode, f"generation failed: {type(exc).__name__}")

    def _next_plan(self) -> tuple[StepPlan[_RequestState], list[_RequestState]] | None:
        """Waits for work, applies aborts and plans the next step (None once stopping); also returns
        the waiting requests whose ``queued`` progress event is due."""
        with self._cv:
            while not (self._stopping or self._aborts or self._scheduler.waiting or self._scheduler.running):
                self._cv.wait()
            if self._stopping:
                return None
            self._apply_aborts()
            return self._scheduler.schedule(), self._queued_progress_due()

    def _queued_progress_due(self) -> list[_RequestState]:
        """Waiting requests whose last ``queued`` event is older than the interval (under the lock)."""
        now = time.monotonic()
        due = [s for s in self._scheduler.waiting if now - s.progress_time >= QUEUED_PROGRESS_INTERVAL_S]
        for state in due:
            state.progress_time = now
        return due

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for key in aborts:
            removed = self._scheduler.remove(key)
            if removed is not None:
                self._runner.release(removed.row_keys)
                self.counters.requests_cancelled += 1

    def _step(self, plan: StepPlan[_RequestState]) -> None:
        """Prefill the new requests (first token), then decode every running row once."""
        self.counters.steps += 1
        events: dict[str, list[Any]] = {}
        if plan.prefill:
            # Sent before the prefill runs, so a caller waiting through a long prompt hears of it.
            _deliver([(s.stream, [Progress("prompt_processing", 0.0)]) for s in plan.prefill])
            now = time.monotonic()
            logits, prefilled = self._runner.prefill([s.request.prompt_token_ids for s in plan.prefill])
            admitted = [(i, s, c) for i, s in enumerate(plan.prefill) for c in s.choices]
            self._runner.admit(prefilled, [(i, c.key) for i, _, c in admitted])
            reused = prefilled.prefix_lengths or [0] * len(plan.prefill)
            for state, cached in zip(plan.prefill, reused, strict=True):
                state.admitted_time = now
                state.cached_tokens = cached
            self.counters.prefix_cache_hit_tokens += sum(reused)
            rows = logits[torch.tensor([i for i, _, _ in admitted])]
            self._take([(s, c) for _, s, c in admitted], rows, events)
            self._release_finished(plan.prefill)
        live = {c.key: (s, c) for s in plan.decode + plan.prefill for c in s.choices if not c.finished}
        if live:
            keys = self._runner.row_keys
            logits = self._runner.decode({key: live[key][1].last_token for key in keys})
            self._take([live[key] for key in keys], logits, events)
        self._release_finished(plan.prefill + plan.decode)
        self._publish(plan.prefill + plan.decode, events)

    def _release_finished(self, states: list[_RequestState]) -> None:
        self._runner.release(c.key for s in states for c in s.choices if c.finished)

    def _take(
        self, rows: list[tuple[_RequestState, _Choice]], logits: torch.Tensor, events: dict[str, list[Any]]
    ) -> None:
        """Samples one token for each row (state, choice) and turns the tokens into events."""
        picks = choose_batch(logits, [c.sampler for _, c in rows], self._token_texts)
        now = time.monotonic()
        for (state, choice), (token_id, logprob) in zip(rows, picks, strict=True):
            self._advance(state, choice, token_id, logprob, now, events.setdefault(state.key, []))

    def _advance(
        self,
        state: _RequestState,
        choice: _Choice,
        token_id: int,
        logprob: TokenLogprob | None,
        now: float,
        out: list[Any],
    ) -> None:
        if choice.first_token_time is None:
            choice.first_token_time = now
            self.counters.time_to_first_token.observe(now - state.request.arrival_time)
        choice.last_token_time = now
        choice.sampler.record(token_id)
        choice.generated += 1
        choice.last_token = token_id
        self.counters.generated_tokens += 1
        opts = state.request.sampling
        if token_id in opts.stop_token_ids or (not opts.ignore_eos and token_id in self._eos):
            self._finish(state, choice, FinishReason.STOP, out, stop_token=token_id)
            return
        if choice.output.thinking:
            choice.reasoning_tokens += 1
        choice.output.add_token(token_id if state.request.return_token_ids else None, logprob)
        text, matched = choice.stops.push(choice.detokenizer.push(token_id))
        out += choice.output.push(text)
        if matched is not None:
            if matched in self._blocked_phrases and matched not in opts.stop:
                out.append(RefusalDelta(choice.index, self._refusal_message))
                self._finish(state, choice, FinishReason.CONTENT_FILTER, out, stop_string=matched)
            else:
                self._finish(state, choice, FinishReason.STOP, out, stop_string=matched)
            return
        constraint = choice.sampler.constraint
        if constraint is not None and constraint.finished:
            self._finish(state, choice, FinishReason.STOP, out)  # the grammar allows nothing more
        elif choice.generated >= opts.max_tokens or self._at_context_end(state, choice):
            self._finish(state, choice, FinishReason.LENGTH, out)

    def _at_context_end(self, state: _RequestState, choice: _Choice) -> bool:
        return state.prompt_length + choice.generated >= self._context_length

    def _finish(
        self,
        state: _RequestState,
        choice: _Choice,
        reason: FinishReason,
        out: list[Any],
        *,
        stop_string: str = "",
        stop_token: int | None = None,
    ) -> None:
        tail = ""
        if not stop_string:
            # Release what the detokenizer and the stop matcher still hold;
            # the tail itself may complete a stop string.
            tail, matched = choice.stops.push(choice.detokenizer.flush())
            if matched is not None:
                reason, stop_string, stop_token = FinishReason.STOP, matched, None
            else:
                tail += choice.stops.flush()
        out += choice.output.finish(tail)
        if reason is FinishReason.STOP and choice.output.tool_calls:
            reason = FinishReason.TOOL_CALLS
        if reason is FinishReason.CONTENT_FILTER:
            stop_string = ""  # the blocked phrase is not shown to the caller
        choice.finished = True
        arrival = state.request.arrival_time
        first = choice.first_token_time or arrival
        timings = Timings(
            queue_seconds=max(0.0, (state.admitted_time or arrival) - arrival),
            time_to_first_token_seconds=max(0.0, first - arrival),
            decode_seconds=max(0.0, (choice.last_token_time or first) - first),
        )
        out.append(Finished(choice.index, reason, choice.generated, stop_string, stop_token, timings))

    def _publish(self, states: list[_RequestState], events: dict[str, list[Any]]) -> None:
        finished = [s for s in states if s.done]
        if finished:
            with self._cv:
                for state in finished:
                    self._scheduler.remove(state.key)
                    self.counters.requests_finished += 1
        ready = []
        for state in states:
            batch = events.get(state.key, [])
            if state.done:
                completion = sum(c.generated for c in state.choices)
                reasoning = sum(c.reasoning_tokens for c in state.choices)
                batch.append(
                    Usage(
                        state.prompt_length,
                        completion,
                        cached_tokens=state.cached_tokens,
                        reasoning_tokens=reasoning,
                    )
                )
                batch.append(_END)
            if batch:
                ready.append((state.stream, batch))
        _deliver(ready)

    def _fail(self, states: list[_RequestState], message: str) -> None:
        # The batch's cache state is unknown after a failed step: drop it all
        # (``states`` is every running request).
        self._runner.reset()
        with self._cv:
            for state in states:
                if self._scheduler.remove(state.key) is not None:
                    self.counters.requests_failed += 1
        _deliver([(state.stream, [Failed(message), _END]) for state in states])
