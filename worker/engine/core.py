"""The engine: the step loop thread that owns the model, and its thread-safe API (``prepare``,
``submit``, ``abort``, ``stop_choices``, ``stats``).

Design notes: docs/worker.md.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from worker.engine.failures import DeviceFailure, EngineFailure, failure_message, raise_if_device_failed
from worker.engine.kv_blocks import BlockManager
from worker.engine.prepare import Prepared, RequestPreparer
from worker.engine.request_stream import RequestStream, StreamOpener
from worker.engine.scheduler import Scheduler, SchedulingFailed, SeqState, StepPlan
from worker.engine.speculation import RowSpeculation, Speculation
from worker.engine.stats import EngineCounters, EngineStats, PublishedStats
from worker.errors import NotReady
from worker.model.device import bind_device
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work
from worker.output.processor import TextRules
from worker.sampling.grammar import GrammarCompiler
from worker.sampling.sampler import Draw, GrammarFailure, Sample, SequenceSampling, draw_batch
from worker.types import (
    ChoiceEnded,
    CoreFailure,
    CoreOutput,
    Dequeued,
    FinishReason,
    GenerationRequest,
    NewToken,
    Progress,
    PromptScored,
)

log = logging.getLogger(__name__)


# A request still waiting for a slot hears ``queued`` again this often, so a caller's idle
# timer (the edge's --idle-timeout) does not mistake a long queue for a dead worker.
QUEUED_PROGRESS_INTERVAL_S = 2.0


# A batch row belongs to one choice of one request: (engine request key, choice index).
RowKey = tuple[str, int]


@dataclass
class _Choice:
    """The core's view of one choice: its sequence (tokens, KV blocks) and its sampling state."""

    key: RowKey
    index: int
    sampling: SequenceSampling
    seq: SeqState
    acceptance: RowSpeculation = field(default_factory=RowSpeculation)  # its speculation's state

    @property
    def finished(self) -> bool:
        return self.seq.finished


@dataclass
class _RequestState:
    key: str
    request: GenerationRequest
    choices: list[_Choice]
    stream: OutputSink
    started: bool = False  # admitted at least once (a preempted request is re-admitted later)
    held: list[CoreOutput] = field(default_factory=list)  # tokens kept back (``stream_interval``)
    held_steps: int = 0  # steps whose tokens ``held`` keeps
    streamed: bool = False  # a token was delivered (the first one is never kept back)
    removed: bool = False  # out of the scheduler (failed, cancelled or finished)
    preempted: bool = False  # back in the queue after running (until admitted again)

    @property
    def request_id(self) -> str:
        return self.key

    @property
    def sequences(self) -> list[SeqState]:
        return [choice.seq for choice in self.choices]

    @property
    def needs_kv(self) -> bool:
        return self.request.sampling.max_tokens > 0

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def done(self) -> bool:
        return all(choice.finished for choice in self.choices)


@dataclass
class _InFlight:
    """A step's draw the host has not read yet: the rows (state, choice) it drew for, where each
    row's placeholder token sits in its sequence, the draw, and the fence to wait on first."""

    rows: list[tuple[_RequestState, _Choice]]
    places: list[int]
    draw: Draw
    ready: Callable[[], None]


class _Control(enum.Enum):
    CANCEL = "cancel"  # the caller went away
    FAIL = "fail"  # the request's output processing failed
    STOP = "stop"  # choices ended by a stop string or blocked phrase


class OutputSink(Protocol):
    """Where a request's outputs go: a :class:`RequestStream` on an event loop, or (an engine in its
    own process) a pipe to the serving process (worker/engine/process.py)."""

    key: str

    @property
    def loop(self) -> Any: ...  # its ``call_soon_threadsafe(callback, items)`` takes a step's outputs

    def put(self, outputs: list[CoreOutput]) -> None: ...


def ended_outputs(ended: FinishReason | None) -> list[CoreOutput]:
    """The outputs of a request that its resumed tokens already ended (no step runs for it)."""
    return [Dequeued(time.monotonic(), 0), ChoiceEnded(0, ended or FinishReason.STOP)]


def deliver(batches: Iterable[tuple[OutputSink, list[CoreOutput]]]) -> None:
    """Hands a step's outputs to their streams, waking each event loop once per step (not once per
    request). Called from the engine thread."""
    by_loop: dict[Any, list[tuple[OutputSink, list[CoreOutput]]]] = {}
    for stream, batch in batches:
        by_loop.setdefault(stream.loop, []).append((stream, batch))
    for loop, items in by_loop.items():
        # A closed loop means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[OutputSink, list[CoreOutput]]]) -> None:
    for stream, batch in items:
        stream.put(batch)


class Engine:
    """Continuous batching over one model. Thread-safe ``prepare``/``submit``/``abort``; ``start`` once."""

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
        prefix_caching: bool = True,
        blocked_phrases: tuple[str, ...] = (),
        refusal_message: str = "I can't help with that.",
        grammars: GrammarCompiler | None = None,
        on_device_failure: Callable[[BaseException], None] | None = None,
        speculation: Speculation | None = None,
        stream_interval: int = 1,
        overlap: bool = False,
    ):
        """The KV pool's size and block size are the runner's (``num_blocks``, ``block_size``);
        ``on_device_failure`` is called (on the engine thread) once the engine cannot go on (its
        device failed, or :class:`EngineFailure`: docs/worker.md, "Failure isolation");
        ``speculation``: speculative decoding (n-gram or draft proposals, every row verified as
        one-token steps would draw it; None: off); ``stream_interval``: a stream's tokens are handed
        over every that many steps (its first token and its end at once), which cuts the per-message
        work of many concurrent streams; ``overlap``: a step's draw is read while the next step's
        forward runs (docs/worker.md, "Steps that overlap"; not with speculation)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        if overlap and speculation is not None:
            raise ValueError("overlapping steps cannot be combined with speculative decoding")
        self._overlap = overlap
        self._in_flight: _InFlight | None = None
        self._stream_interval = stream_interval
        self._on_device_failure = on_device_failure
        self.failure: EngineFailure | None = None  # what stopped the engine, if anything did
        self._runner = runner
        self._eos = frozenset(eos_token_ids)
        self._context_length = context_length
        self._streams = StreamOpener(tokenizer, TextRules(tuple(blocked_phrases), refusal_message))
        self._preparer = RequestPreparer(
            eos_token_ids=self._eos,
            context_length=context_length,
            scores_prompts=runner.scores_prompts,
            grammars=grammars,
        )
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, prefix_caching=prefix_caching)
        self._speculation = speculation
        self._scheduler: Scheduler[_RequestState] = Scheduler(
            self.blocks,
            max_running=max_running,
            max_queue=max_queue,
            prefill_budget_tokens=prefill_budget_tokens,
            propose=self._propose if speculation is not None else None,
            speculate_max_rows=speculation.max_rows if speculation is not None else None,
        )
        self._cv = threading.Condition()
        self._control: list[tuple[str, _Control, tuple[int, ...]]] = []
        self._unended: list[_RequestState] = []  # failed where their failure could not be delivered
        self._progress_due: dict[str, float] = {}  # waiting request key -> when "queued" went out
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="sluice-engine", daemon=True)
        self._ids = itertools.count()
        self.counters = EngineCounters()
        self.published = PublishedStats(self.stats)  # what /metrics reads: never this lock

    # ------------------------------------------------------------ control

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def prepare(self, request: GenerationRequest) -> Prepared:
        """Builds the request's per-choice sampling state (:meth:`RequestPreparer.prepare`: blocking, the
        service calls it in a thread pool, off the event loop). Raises InvalidRequest for what this
        engine cannot do."""
        return self._preparer.prepare(request)

    def submit(self, request: GenerationRequest | Prepared) -> RequestStream:
        """Queues a request (preparing it here if it was not); raises QueueFull at once when the queue is
        at its bound. Call on the event loop that will read the stream."""
        prepared = request if isinstance(request, Prepared) else self.prepare(request)
        req = prepared.request
        key = f"{req.request_id}#{next(self._ids)}"
        stream = self._streams.open(self, req, key)
        if prepared.ended is not None or stream.ended_while_priming:
            # A resumed request that its resumed tokens already ended: finish it without the core
            # (the processor ignores the end of a choice its priming already ended).
            stream.put(ended_outputs(prepared.ended))
            self.count_ended()
            return stream
        # On the stream's own loop (we are on it): "queued" comes before anything the step loop sends.
        stream.put([Progress("queued", 0.0)])
        self.enqueue(prepared, key, stream)
        return stream

    async def queue(self, request: Prepared) -> RequestStream:
        """:meth:`submit` as the service calls it (an engine in its own process answers later)."""
        return self.submit(request)

    def count_ended(self) -> None:
        """Counts a request that ended before it was queued (its resumed tokens ended it)."""
        with self._cv:
            self.counters.requests_submitted += 1
            self.counters.requests_finished += 1
            self._cv.notify_all()  # an idle loop publishes its stats again

    def enqueue(self, prepared: Prepared, key: str, stream: OutputSink) -> None:
        """Puts a prepared request in the scheduler's queue under ``key``; its outputs go to
        ``stream`` (raises QueueFull when the queue is at its bound)."""
        req = prepared.request
        prompt = list(req.prompt_token_ids)
        longest = min(len(prompt) + req.sampling.max_tokens, self._context_length)
        # A resumed request's sequence starts with its resumed tokens as generated ones: the first
        # forward computes prompt plus those, and samples the next token.
        choices = [
            _Choice(
                (key, i),
                i,
                sampling,
                SeqState(
                    list(req.prefill_token_ids), len(prompt), longest, awaits_prompt=i > 0, images=req.images
                ),
            )
            for i, sampling in enumerate(prepared.samplings)
        ]
        state = _RequestState(key, req, choices, stream)
        with self._cv:
            if self._stopping:  # the loop has ended (or is ending): nothing would run this request
                reason = "its engine failed" if self.failure is not None else "it is stopping"
                raise NotReady(f"the worker cannot take requests: {reason}", retry_after_seconds=1.0)
            self._scheduler.add(state)
            self._progress_due[key] = time.monotonic()
            self.counters.requests_submitted += 1
            self.counters.prompt_tokens += len(req.prompt_token_ids)
            self._cv.notify_all()

    def abort(self, key: str, *, failed: bool = False) -> None:
        """Removes the request before the next step, queued or running (cancelled, or failed)."""
        with self._cv:
            self._control.append((key, _Control.FAIL if failed else _Control.CANCEL, ()))
            self._cv.notify_all()

    def stop_choices(self, key: str, choices: Iterable[int]) -> None:
        """Ends these choices of a request before the next step (a stop string was found in their text)."""
        with self._cv:
            self._control.append((key, _Control.STOP, tuple(choices)))
            self._cv.notify_all()

    def stats(self) -> EngineStats:
        with self._cv:
            running = list(self._scheduler.running)
            sequences = [c.seq for r in running for c in r.choices if not c.finished]
            blocks = self.blocks
            return EngineStats(
                waiting_requests=len(self._scheduler.waiting),
                running_requests=len(running),
                running_sequences=len(sequences),
                live_caches=sum(1 for seq in sequences if seq.blocks.table),
                cache_tokens=sum(seq.computed for seq in sequences),
                cache_bytes=self._runner.pool_bytes,
                reserved_tokens=blocks.used * blocks.block_size,
                kv_block_size=blocks.block_size,
                kv_blocks_total=blocks.num_blocks,
                kv_blocks_used=blocks.used,
                fast_path=getattr(self._runner, "fast_path", None),
                graph_replays=getattr(getattr(self._runner, "graphs", None), "replays", 0),
                speculative_proposer=self._speculation.proposer if self._speculation else None,
                counters=replace(self.counters, time_to_first_token=self.counters.time_to_first_token.copy()),
            )

    def latest_stats(self) -> EngineStats:
        """The stats the step loop last published (:class:`PublishedStats`): never waits for it."""
        return self.published.latest

    # --------------------------------------------------------------- loop

    def _loop(self) -> None:
        """Runs turns until stopped; an :class:`EngineFailure` (or a failure of the failure handling
        itself) fails every request and ends the loop, and the owner exits (docs/worker.md)."""
        bind_device(getattr(self._runner, "device", None))  # torch's current CUDA device is per thread
        try:
            while self._turn():
                pass
        except EngineFailure as failure:
            self._stop_failed(failure)
        except BaseException as error:  # a bug in the loop's own handling: no stream may be left open
            log.exception("the engine loop failed")
            self._stop_failed(EngineFailure(f"the engine loop failed: {type(error).__name__}: {error}"))
        else:
            self._end_all("generation failed: the worker's engine stopped")

    def _turn(self) -> bool:
        """One turn of the loop: control messages, a plan and its step. A failure fails the requests it
        belongs to and the loop goes on (:meth:`_contain`); False once stopping."""
        try:
            scheduled = self._next_plan()
        except SchedulingFailed as failure:  # a scheduler bug: no request's plan can be trusted
            failed = [state for state, _ in failure.failed]  # out of the queue: counted here
            with self._cv:
                self.counters.requests_failed += len(failed)
                everyone = [*self._everyone(), *failed]
            self._contain(failure.error, "scheduling", everyone)
            return True
        except Exception as error:  # control messages or the scheduler's state: fail everyone
            with self._cv:
                everyone = self._everyone()
            self._contain(error, "planning", everyone)
            return True
        if scheduled is None:
            return False
        plan, still_queued = scheduled
        if still_queued:
            deliver([(state.stream, [Progress("queued", 0.0)]) for state in still_queued])
        if plan.failed:
            self._failed_planning(plan.failed)
        try:
            if not plan.empty:
                self._step(plan)
            elif self._in_flight is not None:  # nothing to overlap with: read the draw now
                outputs: dict[str, list[CoreOutput]] = {}
                self._publish(self._resolve(outputs), outputs)
        except EngineFailure:
            raise
        except Exception as error:
            self._contain(error, "the step", self._step_requests(plan))
        return True

    def _everyone(self) -> list[_RequestState]:
        """Every request the scheduler holds, waiting or running (under the lock)."""
        return [*self._scheduler.waiting, *self._scheduler.running]

    def _failed_planning(self, failed: list[tuple[_RequestState, Exception]]) -> None:
        """Requests whose planning raised: already out of the queue, each fails alone."""
        outputs: dict[str, list[CoreOutput]] = {}
        with self._cv:  # already out of the queue, so _fail does not count them
            self.counters.requests_failed += len(failed)
        for state, error in failed:
            log.error("planning failed for %s: %r", state.key, error)
            self._fail(state, failure_message(error), outputs)
        self._publish([state for state, _ in failed], outputs)

    def _step_requests(self, plan: StepPlan[_RequestState]) -> list[_RequestState]:
        """The requests a step touched: planned, admitted, or with a token in the draw in flight."""
        owners = {id(c.seq): s for s in self._scheduler.running for c in s.choices}
        states = [*plan.started, *(owners[id(w.seq)] for w in plan.work if id(w.seq) in owners)]
        if self._in_flight is not None:
            states += [state for state, _ in self._in_flight.rows]
        return list({id(s): s for s in states}.values())

    def _contain(self, error: Exception, where: str, states: list[_RequestState]) -> None:
        """Fails ``states`` for ``error`` raised in ``where`` (their draw in flight dropped), then
        checks the block accounting: a failure that left it wrong, or that recurs while failing
        them, stops the engine (:class:`EngineFailure`)."""
        log.error("%s failed; failing %d request(s)", where, len(states), exc_info=error)
        with self._cv:
            self.counters.step_failures += 1
        try:
            self._in_flight = None
            outputs: dict[str, list[CoreOutput]] = {}
            for state in states:
                if not state.removed:
                    self._fail(state, failure_message(error), outputs)
            self._publish(states, outputs)
            with self._cv:
                problem = self.blocks.audit(
                    c.seq.blocks for s in self._scheduler.running for c in s.choices if not c.finished
                )
        except Exception as again:
            self._unended += states  # their failure may not have reached them: the last outputs will
            raise EngineFailure(f"failing the requests of {where} failed: {type(again).__name__}") from again
        if problem is not None:
            raise EngineFailure(f"after {where} failed, the KV block accounting is wrong: {problem}")

    def _stop_failed(self, failure: EngineFailure) -> None:
        """Fails every request and ends the loop; the owner reports NOT_SERVING and exits."""
        log.critical("the engine cannot go on (%s): failing every request; the engine stops", failure)
        with self._cv:
            self.failure = failure
            self._stopping = True
            self._in_flight = None
        message = (
            "generation failed: the worker's device failed"
            if isinstance(failure, DeviceFailure)
            else "generation failed: the worker's engine failed"
        )
        self._end_all(message)
        if self._on_device_failure is not None:
            self._on_device_failure(failure)

    def _end_all(self, message: str) -> None:
        """Ends every request the engine holds with ``message`` (the loop is ending), touching neither
        the scheduler's blocks nor anything else that may have failed."""
        with self._cv:
            self._stopping = True
            held = self._everyone()
            self.counters.requests_failed += len(held)
            everyone = list({id(s): s for s in [*held, *self._unended]}.values())
            for state in everyone:
                state.removed = True
            self._scheduler.waiting.clear()
            self._scheduler.running.clear()
        try:
            deliver((state.stream, [CoreFailure(message)]) for state in everyone)
        except Exception:
            log.exception("the engine's last outputs could not be delivered")

    def _next_plan(self) -> tuple[StepPlan[_RequestState], list[_RequestState]] | None:
        """Waits for work, applies control messages and plans the next step (None once stopping); also
        returns the waiting requests whose ``queued`` progress event is due."""
        with self._cv:
            while not (self._stopping or self._control or self._scheduler.waiting or self._scheduler.running):
                self.published.refresh()  # idle: the published stats are exact
                self._cv.wait()
            if self._stopping:
                return None
            self._apply_control()
            plan = self._scheduler.schedule()
            for state in plan.started:
                self._progress_due.pop(state.key, None)
            self.published.refresh_if_due()
            return plan, self._queued_progress_due()

    def _queued_progress_due(self) -> list[_RequestState]:
        """Waiting requests whose last ``queued`` event is older than the interval (under the lock)."""
        now = time.monotonic()
        due = [
            s
            for s in self._scheduler.waiting
            if now - self._progress_due.get(s.key, now) >= QUEUED_PROGRESS_INTERVAL_S
        ]
        for state in due:
            self._progress_due[state.key] = now
        return due

    def _apply_control(self) -> None:
        """Applies aborts and text-level stops (under the lock)."""
        control, self._control = self._control, []
        for key, kind, choices in control:
            if kind is _Control.STOP:  # running or waiting (a preempted request hears its stop too)
                queues = (self._scheduler.running, self._scheduler.waiting)
                state = next((s for q in queues for s in q if s.key == key), None)
                if state is None:
                    continue
                for choice in state.choices:
                    if choice.index in choices and not choice.finished:
                        self._scheduler.finish(choice.seq)
                if state.done:
                    self._scheduler.remove(key)
                    state.removed = True
                    self._progress_due.pop(key, None)
                    self.counters.requests_finished += 1
                continue
            removed = self._scheduler.remove(key)
            self._progress_due.pop(key, None)
            if removed is not None:
                removed.removed = True
                if kind is _Control.FAIL:
                    self.counters.requests_failed += 1
                else:
                    self.counters.requests_cancelled += 1

    def _step(self, plan: StepPlan[_RequestState]) -> None:
        """Runs one planned step: the forward over every planned sequence's tokens, then a sample for
        each sequence that reached its last token; hands each request its outputs. Never raises:
        failures end the requests they belong to."""
        self.counters.steps += 1
        outputs: dict[str, list[CoreOutput]] = {}
        if plan.preempted:
            readmitted = {id(s) for s in plan.started}  # preempted and admitted again in this plan
            self._preempted([s for s in plan.preempted if id(s) not in readmitted])
        owners = {id(c.seq): (s, c) for s in [*self._scheduler.running] for c in s.choices}
        for state in plan.started:
            state.preempted = False
        fresh = [s for s in plan.started if not s.started]
        if fresh:
            self._start(fresh, outputs)
        work = plan.work
        if outputs:  # a fresh request's scoring may have failed it
            work = [w for w in work if not _failed(outputs.get(owners[id(w.seq)][0].key, []))]
        # A step without a forward reads the draw in flight now; ``_run`` reads it during its forward.
        resolved = self._run(work, owners, outputs) if work else self._resolve(outputs)
        touched = {id(s): s for s in [*resolved, *fresh, *(owners[id(w.seq)][0] for w in plan.work)]}
        self._publish(list(touched.values()), outputs)

    def _preempted(self, states: list[_RequestState]) -> None:
        """Requests sent back to the queue: they keep their tokens and hear ``queued`` while waiting."""
        # Their kept-back tokens go out now, before the ``queued`` they hear next.
        deliver([(s.stream, _paced(s, [], 1) or []) for s in states if s.held])
        now = time.monotonic()
        with self._cv:
            self.counters.preemptions += len(states)
            for state in states:
                self._progress_due[state.key] = now
                state.preempted = True
        log.info("preempted %d request(s) for KV blocks; they will be recomputed", len(states))

    def _start(self, states: list[_RequestState], outputs: dict[str, list[CoreOutput]]) -> None:
        """First admission: prompt processing starts (scored first when asked), and the prefix cache's
        share of the prompt is reported."""
        # Sent before the forward runs, so a caller waiting through a long prompt hears of it.
        deliver([(s.stream, [Progress("prompt_processing", 0.0)]) for s in states])
        now = time.monotonic()
        for state in states:
            state.started = True
            # The prompt's share the prefix cache supplied: what this admission attached, or (a
            # scoring-only request attaches nothing) what the cache holds of the prompt.
            seq = state.choices[0].seq
            cached = seq.cached_tokens if state.needs_kv else self.blocks.cached_length(seq.cache_keys)
            self.counters.prefix_cache_hit_tokens += cached
            if state.request.sampling.prompt_logprobs is not None:
                self._score(state, now, cached, outputs)
            elif state.needs_kv:
                outputs.setdefault(state.key, []).append(Dequeued(now, cached))

    def _run(
        self,
        work: list[Work],
        owners: dict[int, tuple[_RequestState, _Choice]],
        outputs: dict[str, list[CoreOutput]],
    ) -> list[_RequestState]:
        """The step's forward (see docs/worker.md for what a failure fails), then sampling; raises
        :class:`DeviceFailure` when the device failed. The previous step's draw, if still in flight,
        is read while this forward runs (:meth:`_resolve`); returns the requests it was for."""
        if all(w.count == 1 and not w.proposals for w in work):
            self.counters.decode_only_steps += 1
        fed = self._in_flight.draw.chosen if self._in_flight is not None else None
        sampling = [w for w in work if w.sample]  # the logits' rows, read before anything ends
        error: Exception | None = None
        try:
            logits = self._runner.execute(work, fed)
        except Exception as exc:
            raise_if_device_failed(exc)
            error = exc
        resolved = self._resolve(outputs)
        if resolved:  # rows the previous draw ended (or failed) go no further
            work = [w for w in work if not (w.seq.finished or owners[id(w.seq)][0].removed)]
        if error is not None:
            log.error("forward failed", exc_info=error)
            chunks = [w for w in work if w.count > 1]
            decodes = [w for w in work if w.count == 1]
            blamed = chunks if chunks and decodes else work
            for state in {id(s): s for s in (owners[id(w.seq)][0] for w in blamed)}.values():
                self._fail(state, failure_message(error), outputs)
            if blamed is work:
                return resolved
            work = [w for w in decodes if not _failed(outputs.get(owners[id(w.seq)][0].key, []))]
            if not work:
                return resolved
            try:
                sampling = [w for w in work if w.sample]
                logits = self._runner.execute(work)
            except Exception as again:
                raise_if_device_failed(again)
                log.exception("decode forward failed")
                for state in {id(s): s for s in (owners[id(w.seq)][0] for w in work)}.values():
                    self._fail(state, failure_message(again), outputs)
                return resolved
        # Both read ``computed``, which the commit moves. A prompt computed in chunks reports how far
        # it got after each chunk that did not finish it. A verified row commits once its accepted
        # tokens are known (:meth:`_verify`).
        going = {id(w) for w in work}
        chunked = [owners[id(w.seq)] + (w.seq,) for w in work if not w.sample and w.seq.generated == 0]
        with self._cv:
            for item in work:
                if not item.proposals:
                    self._scheduler.committed(item)
        if chunked:
            deliver(
                (state.stream, [Progress("prompt_processing", seq.computed / max(1, seq.prompt_length))])
                for state, choice, seq in chunked
                if choice.index == 0
            )
        rows: list[tuple[_RequestState, _Choice]] = []
        indexes: list[int] = []  # the logits row of each sampled row
        verified: list[tuple[Work, int]] = []  # each verifying item and its first logits row
        row = 0
        for item in sampling:
            if id(item) not in going:  # computed, but its request ended meanwhile
                row += 1 + len(item.proposals)
                continue
            if item.proposals:
                verified.append((item, row))
                row += 1 + len(item.proposals)
                continue
            state, choice = owners[id(item.seq)]
            rows.append((state, choice))
            indexes.append(row)
            if choice.seq.generated == 0:  # the prompt is done: waiting siblings draw from it too
                for sibling in state.choices:
                    if sibling.seq.awaits_prompt:
                        sibling.seq.awaits_prompt = False
                        rows.append((state, sibling))
                        indexes.append(row)
            row += 1
        if rows:
            picked = logits
            if len(indexes) != logits.shape[0] or indexes != list(range(len(indexes))):
                picked = logits[torch.tensor(indexes, device=logits.device)]
            self._sample(rows, picked, outputs, defer=self._overlap)
        if verified:
            self._verify(verified, logits, owners, outputs)
        return resolved

    def _score(
        self, state: _RequestState, now: float, cached: int, outputs: dict[str, list[CoreOutput]]
    ) -> None:
        """The prompt's logprobs; a scoring-only request (max_tokens 0) ends here."""
        top_n = state.request.sampling.prompt_logprobs or 0
        try:
            entries = self._runner.score(state.request.prompt_token_ids, top_n)
        except Exception as exc:
            raise_if_device_failed(exc)
            log.exception("scoring the prompt of %s failed", state.key)
            self._fail(state, failure_message(exc), outputs)
            return
        out = outputs.setdefault(state.key, [])
        out += [Dequeued(now, cached), PromptScored(tuple(entries))]
        if state.request.sampling.max_tokens == 0:
            with self._cv:
                for choice in state.choices:
                    self._scheduler.finish(choice.seq)
                    out.append(ChoiceEnded(choice.index, FinishReason.LENGTH))

    def _sample(
        self,
        rows: list[tuple[_RequestState, _Choice]],
        logits: torch.Tensor,
        outputs: dict[str, list[CoreOutput]],
        *,
        defer: bool = False,
    ) -> None:
        """Draws one token for each row (state, choice) on the device. Until the host reads the draw
        (:meth:`_resolve`), each row's next place in its sequence holds a placeholder naming its row
        of the draw, which the next step's inputs read on the device; ``defer``: the draw is read
        while the next step's forward runs, else now."""
        try:
            draw = draw_batch(logits, [c.sampling for _, c in rows])
        except Exception as exc:  # a sampling bug: these rows cannot go on, the cache is fine
            raise_if_device_failed(exc)
            log.exception("sampling failed")
            for state in {id(s): s for s, _ in rows}.values():
                self._fail(state, failure_message(exc), outputs)
            return
        places = []
        for row, (_, choice) in enumerate(rows):
            places.append(len(choice.seq.tokens))
            choice.seq.tokens.append(-(row + 1))
        self._in_flight = _InFlight(rows, places, draw, self._runner.ready())
        if not defer:
            self._resolve(outputs)

    def _resolve(self, outputs: dict[str, list[CoreOutput]]) -> list[_RequestState]:
        """Reads the draw in flight, if any (waiting for the device first): each row still going
        gets its token in place of the placeholder, and the token-level stops apply. Returns the
        requests the draw was for."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        rows = in_flight.rows
        states = list({id(s): s for s, _ in rows}.values())
        failed: dict[str, str] = {}
        try:
            in_flight.ready()
            samples = in_flight.draw.samples()
        except GrammarFailure as exc:
            samples = exc.samples
            for row in exc.rows:
                failed[rows[row][0].key] = "generation failed: the grammar could not be applied"
        except Exception as exc:
            raise_if_device_failed(exc)
            log.exception("reading the draw failed")
            for state in states:
                if not state.removed:
                    self._fail(state, failure_message(exc), outputs)
            return states
        now = time.monotonic()
        tokens: list[NewToken] = []
        first_tokens: list[float] = []  # each first token's time since its request arrived
        for (state, choice), place, sample in zip(rows, in_flight.places, samples, strict=True):
            if state.removed or state.key in failed or choice.finished:
                continue
            try:
                tokens.append(self._advance(state, choice, place, sample, now))
            except Exception as exc:
                log.exception("advancing %s failed", state.key)
                failed[state.key] = failure_message(exc)
                continue
            outputs.setdefault(state.key, []).append(tokens[-1])
            if choice.sampling.generated == 1:
                first_tokens.append(now - state.request.arrival_time)
        with self._cv:  # the counters stats() copies, under its lock
            self.counters.generated_tokens += len(tokens)
            for seconds in first_tokens:
                self.counters.time_to_first_token.observe(seconds)
        for state in states:
            if state.key in failed and not state.removed:
                self._fail(state, failed[state.key], outputs)
        return states

    def _propose(self, state: _RequestState, seq: SeqState, room: int) -> list[int]:
        """The scheduler's proposer (called under the lock): an eligible choice's proposals once it
        has generated (its first token comes from the prompt's forward). A draft model's forward runs
        with the lock released; a proposer that raises costs this row its proposals for this step."""
        assert self._speculation is not None
        if seq.generated == 0:
            return []
        choice = next(c for c in state.choices if c.seq is seq)
        try:
            with self._unlocked() if self._speculation.draft is not None else contextlib.nullcontext():
                return self._speculation.proposals(choice.sampling, choice.acceptance, seq.tokens, room)
        except Exception as error:
            raise_if_device_failed(error)
            log.warning("proposing for %s failed (no proposals this step): %r", state.key, error)
            self.counters.speculative_proposal_failures += 1
            return []

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """Releases the lock the engine thread holds for a while. Safe while planning proposals: the
        other threads only queue requests and control messages or read stats; the running set and
        the blocks change on this thread alone."""
        self._cv.release()
        try:
            yield
        finally:
            self._cv.acquire()

    def _verify(
        self,
        verified: list[tuple[Work, int]],
        logits: torch.Tensor,
        owners: dict[int, tuple[_RequestState, _Choice]],
        outputs: dict[str, list[CoreOutput]],
    ) -> None:
        """Rows that verified proposals draw their tokens position by position, each draw made
        exactly as a one-token step makes it (:meth:`_sample`: the row's processing, penalties,
        masks, logprobs and seeded uniform for that output position); a draw equal to the proposal
        accepts it and the row draws again at the next position, any other draw (or a stop) ends
        the row's step. For a point-mass draft this is speculative sampling's rejection rule
        (docs/worker.md). Then each row commits what it kept."""
        assert self._speculation is not None
        live = [(item, first, *owners[id(item.seq)]) for item, first in verified]
        kept = {id(item): 0 for item, _ in verified}
        position = 0
        while live:
            before = [choice.sampling.generated for _, _, _, choice in live]
            index = torch.tensor([first + position for _, first, _, _ in live], device=logits.device)
            self._sample([(state, choice) for _, _, state, choice in live], logits[index], outputs)
            going = []
            for (item, first, state, choice), count in zip(live, before, strict=True):
                drawn = choice.sampling.output_token_ids[count:]
                if position < len(item.proposals) and drawn == [item.proposals[position]]:
                    kept[id(item)] += 1
                    if not (choice.finished or _failed(outputs.get(state.key, []))):
                        going.append((item, first, state, choice))
            live = going
            position += 1
        proposed = taken = paused = 0
        for item, _ in verified:
            state, choice = owners[id(item.seq)]
            proposed += len(item.proposals)
            taken += kept[id(item)]
            paused += self._speculation.observe(
                choice.acceptance, len(item.proposals), kept[id(item)], choice.sampling.generated
            )
            if not choice.finished:
                with self._cv:
                    self._scheduler.committed(item, accepted=kept[id(item)])
        with self._cv:
            self.counters.speculative_proposed_tokens += proposed
            self.counters.speculative_accepted_tokens += taken
            self.counters.speculative_paused_rows += paused
        log.debug("speculation: %d of %d proposed tokens accepted in %d rows", taken, proposed, len(verified))

    def _advance(
        self, state: _RequestState, choice: _Choice, place: int, sample: Sample, now: float
    ) -> NewToken:
        """Records a drawn token (at ``place``, its placeholder's) and decides the token-level end of
        the choice."""
        sampling, token = choice.sampling, sample.token_id
        sampling.record(token)
        choice.seq.tokens[place] = token
        generated = sampling.generated
        opts = state.request.sampling
        finish, stop_token = None, None
        if token in opts.stop_token_ids or (not opts.ignore_eos and token in self._eos):
            finish, stop_token = FinishReason.STOP, token
        elif sampling.constraint is not None and sampling.constraint.finished:
            finish = FinishReason.STOP  # the grammar allows nothing more
        elif generated >= opts.max_tokens or choice.seq.prompt_length + generated >= self._context_length:
            finish = FinishReason.LENGTH
        if finish is not None:
            with self._cv:
                self._scheduler.finish(choice.seq)
        return NewToken(choice.index, token, now, sample.logprobs, finish, stop_token)

    def _fail(self, state: _RequestState, message: str, outputs: dict[str, list[CoreOutput]]) -> None:
        """Ends one request with a failure: out of the scheduler, its blocks freed."""
        with self._cv:
            removed = self._scheduler.remove(state.key)
            state.removed = True
            self._progress_due.pop(state.key, None)
            if removed is not None:
                self.counters.requests_failed += 1
            for choice in state.choices:
                if not choice.finished:
                    self._scheduler.finish(choice.seq)
        outputs.setdefault(state.key, []).append(CoreFailure(message))

    def _publish(self, states: list[_RequestState], outputs: dict[str, list[CoreOutput]]) -> None:
        finished = [s for s in states if s.done and not _failed(outputs.get(s.key, []))]
        if finished:
            with self._cv:
                for state in finished:
                    self._progress_due.pop(state.key, None)
                    state.removed = True
                    if self._scheduler.remove(state.key) is not None:
                        self.counters.requests_finished += 1
        batches = []
        for state in {id(s): s for s in states}.values():
            out = outputs.get(state.key)
            # A preempted request's token read after it went back to the queue goes out at once,
            # as its kept-back ones did (:meth:`_preempted`).
            if out is not None and self._stream_interval > 1 and not state.preempted:
                out = _paced(state, out, self._stream_interval)
            if out is not None:
                batches.append((state.stream, out))
        if any(state.removed for state in states):  # a scrape after a request's end counts it
            self.published.refresh()
        deliver(batches)


def _paced(state: _RequestState, outputs: list[CoreOutput], interval: int) -> list[CoreOutput] | None:
    """What to deliver of a step's ``outputs`` under a stream interval: None while plain tokens are
    kept back (fewer than ``interval`` steps of them); anything else (a first token, an end, a
    failure, progress) goes out at once with whatever was kept."""
    if state.streamed and all(type(o) is NewToken and o.finish is None for o in outputs):
        state.held += outputs
        state.held_steps += 1
        if state.held_steps < interval:
            return None
        outputs = state.held
    elif state.held:
        outputs = state.held + outputs
    state.held, state.held_steps = [], 0
    state.streamed = state.streamed or any(type(o) is NewToken for o in outputs)
    return outputs


def _failed(outputs: list[CoreOutput]) -> bool:
    return any(isinstance(item, CoreFailure) for item in outputs)
