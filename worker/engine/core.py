"""The engine: the step loop thread that owns the model (schedule -> execute -> update), and its
thread-safe API (``prepare``, ``submit``, ``abort``, ``stop_choices``, ``stats``).

Design notes: docs/worker.md.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from worker.engine import sink
from worker.engine.failures import Containment, EngineFailure, failure_message, raise_if_device_failed
from worker.engine.kv_blocks import BlockManager
from worker.engine.options import EngineOptions
from worker.engine.prepare import Prepared, RequestPreparer
from worker.engine.request_stream import RequestStream, StreamOpener
from worker.engine.requests import Control, Ledger, Outputs, Owners, RequestState, failed, unique
from worker.engine.scheduler import Scheduler, SeqState, StepPlan
from worker.engine.speculation import Speculation
from worker.engine.state_slots import state_checkpoints
from worker.engine.stats import EngineCounters, EngineStats, PublishedStats
from worker.engine.update import Update
from worker.errors import NotReady
from worker.model.device import bind_device
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work
from worker.output.processor import TextRules
from worker.sampling.grammar import GrammarCompiler
from worker.types import ChoiceEnded, Dequeued, FinishReason, GenerationRequest, Progress, PromptScored

log = logging.getLogger(__name__)


class Engine:
    """Continuous batching over one model. Thread-safe ``prepare``/``submit``/``abort``; ``start`` once."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        *,
        eos_token_ids: Iterable[int],
        context_length: int,
        options: EngineOptions | None = None,
        grammars: GrammarCompiler | None = None,
        on_device_failure: Callable[[BaseException], None] | None = None,
        speculation: Speculation | None = None,
    ):
        """The KV pool's size and block size are the runner's (``num_blocks``, ``block_size``);
        ``on_device_failure`` is called (on the engine thread) once the engine cannot go on (its device
        failed, or :class:`EngineFailure`: docs/worker.md, "Failure isolation"); ``speculation``:
        speculative decoding (every row verified as one-token steps would draw it; None: off)."""
        options = options or EngineOptions()
        if options.overlap and speculation is not None:
            raise ValueError("overlapping steps cannot be combined with speculative decoding")
        self._runner = runner
        self._eos = frozenset(eos_token_ids)
        self._context_length = context_length
        self._streams = StreamOpener(tokenizer, TextRules(options.blocked_phrases, options.refusal_message))
        self._preparer = RequestPreparer(
            eos_token_ids=self._eos,
            context_length=context_length,
            scores_prompts=runner.scores_prompts,
            grammars=grammars,
        )
        self.blocks = BlockManager(
            runner.num_blocks, runner.block_size, prefix_caching=options.prefix_caching
        )
        self._speculation = speculation
        self._scheduler: Scheduler[RequestState] = Scheduler(
            self.blocks,
            max_running=options.max_running,
            max_queue=options.max_queue,
            prefill_budget_tokens=options.prefill_budget_tokens,
            propose=self._propose if speculation is not None else None,
            speculate_max_rows=speculation.max_rows if speculation is not None else None,
            checkpoints=state_checkpoints(runner),
            policy=options.policy(),
        )
        self.counters = EngineCounters()
        self._ledger = Ledger(self._scheduler, self.counters)
        self._cv = self._ledger.cv
        self.published = PublishedStats(self.stats)  # what /metrics reads: never this lock
        self._update = Update(
            self._ledger,
            runner,
            self.published,
            eos=self._eos,
            context_length=context_length,
            speculation=speculation,
            stream_interval=options.stream_interval,
            overlap=options.overlap,
        )
        self._failures = Containment(self._ledger, self._update, on_device_failure)
        self._thread = threading.Thread(target=self._loop, name="sluice-engine", daemon=True)
        self._ids = itertools.count()

    # ------------------------------------------------------------ control

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._ledger.stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def failure(self) -> EngineFailure | None:
        """What stopped the engine, if anything did."""
        return self._failures.failure

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
            stream.put(sink.ended_outputs(prepared.ended))
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

    def enqueue(self, prepared: Prepared, key: str, stream: sink.OutputSink) -> None:
        """Puts a prepared request in the scheduler's queue under ``key``; its outputs go to
        ``stream`` (raises QueueFull when the queue is at its bound)."""
        state = RequestState.of(prepared, key, stream, self._context_length)
        with self._cv:
            if self._ledger.stopping:  # the loop has ended (or is ending): nothing would run this request
                reason = "its engine failed" if self.failure is not None else "it is stopping"
                raise NotReady(f"the worker cannot take requests: {reason}", retry_after_seconds=1.0)
            self._ledger.add(state)

    def abort(self, key: str, *, failed: bool = False) -> None:
        """Removes the request before the next step, queued or running (cancelled, or failed)."""
        with self._cv:
            self._ledger.control.append((key, Control.FAIL if failed else Control.CANCEL, ()))
            self._cv.notify_all()

    def stop_choices(self, key: str, choices: Iterable[int]) -> None:
        """Ends these choices of a request before the next step (a stop string was found in their text)."""
        with self._cv:
            self._ledger.control.append((key, Control.STOP, tuple(choices)))
            self._cv.notify_all()

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state and counters (:meth:`EngineStats.of`)."""
        with self._cv:
            proposer = self._speculation.proposer if self._speculation else None
            return EngineStats.of(self._scheduler, self._runner, proposer, self.counters)

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
            self._failures.stop(failure)
        except BaseException as error:  # a bug in the loop's own handling: no stream may be left open
            log.exception("the engine loop failed")
            self._failures.stop(EngineFailure(f"the engine loop failed: {type(error).__name__}: {error}"))
        else:
            self._failures.end_all("generation failed: the worker's engine stopped")

    def _turn(self) -> bool:
        """One turn of the loop: control messages, a plan and its step. A failure fails the requests it
        belongs to and the loop goes on (:class:`Containment`); False once stopping."""
        try:
            scheduled = self._next_plan()
        except Exception as error:  # control messages or the scheduler's state: fail everyone
            self._failures.planning_failed(error)
            return True
        if scheduled is None:
            return False
        plan, still_queued = scheduled
        if still_queued:
            sink.deliver([(state.stream, [Progress("queued", 0.0)]) for state in still_queued])
        if plan.failed:
            self._failures.start_failed(plan.failed)
        try:
            if not plan.empty:
                self._step(plan)
            elif self._update.in_flight is not None:  # nothing to overlap with: read the draw now
                outputs: Outputs = {}
                self._update.publish(self._update.resolve(outputs), outputs)
        except EngineFailure:
            raise
        except Exception as error:
            self._failures.contain(error, "the step", self._step_requests(plan))
        return True

    def _next_plan(self) -> tuple[StepPlan[RequestState], list[RequestState]] | None:
        """Waits for work, applies control messages and plans the next step (None once stopping); also
        returns the waiting requests whose ``queued`` progress event is due."""
        with self._cv:
            ledger = self._ledger
            while not (
                ledger.stopping or ledger.control or self._scheduler.waiting or self._scheduler.running
            ):
                self.published.refresh()  # idle: the published stats are exact
                self._cv.wait()
            if ledger.stopping:
                return None
            ledger.apply_control()
            plan = self._scheduler.schedule()
            for state in plan.started:
                ledger.progress_due.pop(state.key, None)
            self.published.refresh_if_due()
            return plan, ledger.queued_progress_due()

    def _step_requests(self, plan: StepPlan[RequestState]) -> list[RequestState]:
        """The requests a step touched: planned, started, or with a token in the draw in flight."""
        owners = {id(c.seq): s for s in self._scheduler.running for c in s.choices}
        states = [*plan.started, *(owners[id(w.seq)] for w in plan.work if id(w.seq) in owners)]
        if self._update.in_flight is not None:
            states += [state for state, _ in self._update.in_flight.rows]
        return unique(states)

    # --------------------------------------------------------------- step

    def _step(self, plan: StepPlan[RequestState]) -> None:
        """One planned step: schedule (its starts and preemptions) -> execute (the forward over every
        planned sequence's tokens) -> update (commit, draw, stops, publish). Failures end the
        requests they belong to (docs/worker.md, "Failure isolation")."""
        self.counters.steps += 1
        outputs: Outputs = {}
        owners: Owners = {id(c.seq): (s, c) for s in self._scheduler.running for c in s.choices}
        fresh = self._schedule(plan, outputs)
        work = plan.work
        if outputs:  # a fresh request's scoring may have failed it
            work = [w for w in work if not failed(outputs.get(owners[id(w.seq)][0].key, []))]
        # A step without a forward reads the draw in flight now; ``_run`` reads it during its forward.
        resolved = self._run(work, owners, outputs) if work else self._update.resolve(outputs)
        touched = [*resolved, *fresh, *(owners[id(w.seq)][0] for w in plan.work)]
        self._update.publish(unique(touched), outputs)

    def _schedule(self, plan: StepPlan[RequestState], outputs: Outputs) -> list[RequestState]:
        """The plan's preemptions and starts; returns the requests starting for the first time."""
        if plan.preempted:
            again = {id(s) for s in plan.started}  # preempted and started again in this plan
            self._update.preempted([s for s in plan.preempted if id(s) not in again])
        for state in plan.started:
            state.preempted = False
        fresh = [s for s in plan.started if not s.started]
        if fresh:
            self._begin(fresh, outputs)
        return fresh

    def _begin(self, states: list[RequestState], outputs: Outputs) -> None:
        """A first start: prompt processing begins (scored first when asked), and the prefix cache's
        share of the prompt is reported."""
        # Sent before the forward runs, so a caller waiting through a long prompt hears of it.
        sink.deliver([(s.stream, [Progress("prompt_processing", 0.0)]) for s in states])
        now = time.monotonic()
        for state in states:
            state.started = True
            # The prompt's share the prefix cache supplied: what this start attached, or (a
            # scoring-only request attaches nothing) what the cache holds of the prompt.
            seq = state.choices[0].seq
            cached = seq.cached_tokens if state.needs_kv else self.blocks.cached_length(seq.cache_keys)
            self.counters.prefix_cache_hit_tokens += cached
            if state.request.sampling.prompt_logprobs is not None:
                self._score(state, now, cached, outputs)
            elif state.needs_kv:
                outputs.setdefault(state.key, []).append(Dequeued(now, cached))

    def _score(self, state: RequestState, now: float, cached: int, outputs: Outputs) -> None:
        """The prompt's logprobs; a scoring-only request (max_tokens 0) ends here."""
        top_n = state.request.sampling.prompt_logprobs or 0
        try:
            entries = self._runner.score(state.request.prompt_token_ids, top_n, state.request.lora)
        except Exception as exc:
            raise_if_device_failed(exc)
            log.exception("scoring the prompt of %s failed", state.key)
            self._ledger.fail(state, failure_message(exc), outputs)
            return
        out = outputs.setdefault(state.key, [])
        out += [Dequeued(now, cached), PromptScored(tuple(entries))]
        if state.request.sampling.max_tokens == 0:
            for choice in state.choices:
                self._ledger.finish(choice.seq)
                out.append(ChoiceEnded(choice.index, FinishReason.LENGTH))

    def _run(self, work: list[Work], owners: Owners, outputs: Outputs) -> list[RequestState]:
        """Execute, then update: the step's forward, then its rows' draws; raises
        :class:`DeviceFailure` when the device failed. The previous step's draw, if still in flight,
        is read while this forward runs (:meth:`Update.resolve`); returns the requests it was for."""
        if all(w.count == 1 and not w.proposed for w in work):
            self.counters.decode_only_steps += 1
        in_flight = self._update.in_flight
        sampling = [w for w in work if w.sample]  # the logits' rows, read before anything ends
        logits, error = self._forward(work, in_flight.draw.chosen if in_flight is not None else None)
        resolved = self._update.resolve(outputs)
        if resolved:  # rows the previous draw ended (or failed) go no further
            work = [w for w in work if not (w.seq.finished or owners[id(w.seq)][0].removed)]
        if error is not None:  # the step's decode rows run again on their own, if it had prompt chunks
            # A hybrid's rows cannot run again: its recurrent layers already moved their states.
            rerun = getattr(self._runner, "states", None) is None
            work = self._failures.forward_failed(error, work, owners, outputs, rerun_decodes=rerun)
            sampling = [w for w in work if w.sample]
            logits, error = self._forward(work) if work else (None, None)
            if error is not None:
                log.error("decode forward failed", exc_info=error)
                self._failures.fail_rows(error, work, owners, outputs)
        if logits is not None and error is None:
            self._update.update(work, sampling, logits, owners, outputs)
        return resolved

    def _forward(
        self, work: list[Work], fed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, Exception | None]:
        """The runner's forward over ``work``: its logits, or the error it raised (a device failure
        raises :class:`DeviceFailure`)."""
        try:
            return self._runner.execute(work, fed), None
        except Exception as exc:
            raise_if_device_failed(exc)
            return None, exc

    # ------------------------------------------------------- speculation

    def _propose(self, state: RequestState, seq: SeqState, room: int) -> list[int]:
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
