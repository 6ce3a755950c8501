"""A step's update once its forward ran: commit the KV, draw each row's token (or verify its
proposals), read the draw, apply the token-level stops, and publish the outputs.

Design notes: docs/worker.md ("`worker/engine/core.py`", "Steps that overlap").
"""

from __future__ import annotations

import logging
import time

import torch

from worker.engine import sink
from worker.engine.failures import failure_message, raise_if_device_failed
from worker.engine.requests import (
    Choice,
    InFlight,
    Ledger,
    Outputs,
    Owners,
    RequestState,
    Rows,
    failed,
    unique,
)
from worker.engine.speculation import Speculation
from worker.engine.stats import PublishedStats
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work
from worker.sampling.sampler import GrammarFailure, Sample, draw_batch
from worker.sampling.verify import accepted
from worker.types import FinishReason, NewToken, Progress

log = logging.getLogger(__name__)


class Update:
    """The engine's update side (engine thread only). ``in_flight``: the draw not read yet."""

    def __init__(
        self,
        ledger: Ledger,
        runner: ModelRunner,
        published: PublishedStats,
        *,
        eos: frozenset[int],
        context_length: int,
        speculation: Speculation | None,
        stream_interval: int,
        overlap: bool,
    ):
        self._ledger = ledger
        self._runner = runner
        self._published = published
        self._eos = eos
        self._context_length = context_length
        self._speculation = speculation
        self._stream_interval = stream_interval
        self._overlap = overlap
        self.in_flight: InFlight | None = None

    def update(
        self, work: list[Work], sampling: list[Work], logits: torch.Tensor, owners: Owners, outputs: Outputs
    ) -> None:
        """After the forward: commits ``work`` (what still goes on), reports chunked prompts'
        progress, and draws or verifies the rows of ``sampling`` (the items ``logits`` has rows for,
        in order). A verifying row commits once its accepted tokens are known."""
        # Both read ``computed``, which the commit moves. A prompt computed in chunks reports how far
        # it got after each chunk that did not finish it.
        chunked = [owners[id(w.seq)] + (w.seq,) for w in work if not w.sample and w.seq.generated == 0]
        with self._ledger.cv:
            for item in work:
                if not item.proposed:
                    self._ledger.scheduler.committed(item)
        if chunked:
            sink.deliver(
                (state.stream, [Progress("prompt_processing", seq.computed / max(1, seq.prompt_length))])
                for state, choice, seq in chunked
                if choice.index == 0
            )
        going = {id(w) for w in work}
        rows, indexes, verified = self._rows(sampling, going, owners)
        if rows:
            picked = logits
            if len(indexes) != logits.shape[0] or indexes != list(range(len(indexes))):
                picked = logits[torch.tensor(indexes, device=logits.device)]
            self.sample(rows, picked, outputs, defer=self._overlap)
        if verified:
            self._verify(verified, logits, owners, outputs)

    def _rows(
        self, sampling: list[Work], going: set[int], owners: Owners
    ) -> tuple[Rows, list[int], list[tuple[Work, int]]]:
        """The rows to draw for and each one's logits row, and each verifying item with its first
        logits row; a prompt that is done lets its waiting siblings draw from its row too."""
        rows: Rows = []
        indexes: list[int] = []
        verified: list[tuple[Work, int]] = []
        row = 0
        for item in sampling:
            if id(item) not in going:  # computed, but its request ended meanwhile
                row += 1 + item.proposed
                continue
            if item.proposed:
                verified.append((item, row))
                row += 1 + item.proposed
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
        return rows, indexes, verified

    def sample(self, rows: Rows, logits: torch.Tensor, outputs: Outputs, *, defer: bool = False) -> None:
        """Draws one token for each row (state, choice) on the device. Until the host reads the draw
        (:meth:`resolve`), each row's next place in its sequence holds a placeholder naming its row
        of the draw, which the next step's inputs read on the device; ``defer``: the draw is read
        while the next step's forward runs, else now."""
        try:
            draw = draw_batch(logits, [c.sampling for _, c in rows])
        except Exception as exc:  # a sampling bug: these rows cannot go on, the cache is fine
            raise_if_device_failed(exc)
            log.exception("sampling failed")
            for state in unique([s for s, _ in rows]):
                self._ledger.fail(state, failure_message(exc), outputs)
            return
        places = []
        for row, (_, choice) in enumerate(rows):
            places.append(len(choice.seq.tokens))
            choice.seq.tokens.append(-(row + 1))
        self.in_flight = InFlight(rows, places, draw, self._runner.ready())
        if not defer:
            self.resolve(outputs)

    def resolve(self, outputs: Outputs) -> list[RequestState]:
        """Reads the draw in flight, if any (waiting for the device first): each row still going
        gets its token in place of the placeholder, and the token-level stops apply. Returns the
        requests the draw was for."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return []
        rows = in_flight.rows
        states = unique([s for s, _ in rows])
        failures: dict[str, str] = {}
        try:
            in_flight.ready()
            samples = in_flight.draw.samples()
        except GrammarFailure as exc:
            samples = exc.samples
            for row in exc.rows:
                failures[rows[row][0].key] = "generation failed: the grammar could not be applied"
        except Exception as exc:
            raise_if_device_failed(exc)
            log.exception("reading the draw failed")
            for state in states:
                if not state.removed:
                    self._ledger.fail(state, failure_message(exc), outputs)
            return states
        self._advance_all(in_flight, samples, failures, outputs)
        for state in states:
            if state.key in failures and not state.removed:
                self._ledger.fail(state, failures[state.key], outputs)
        return states

    def _advance_all(
        self, in_flight: InFlight, samples: list[Sample], failures: dict[str, str], outputs: Outputs
    ) -> None:
        """Advances every row of the draw still going by its sample (a row that raises fails its
        request, in ``failures``), and counts the tokens."""
        now = time.monotonic()
        tokens: list[NewToken] = []
        first_tokens: list[tuple[RequestState, float]] = []  # each first token's request, time since arrival
        for (state, choice), place, sample in zip(in_flight.rows, in_flight.places, samples, strict=True):
            if state.removed or state.key in failures or choice.finished:
                continue
            try:
                tokens.append(self._advance(state, choice, place, sample, now))
            except Exception as exc:
                log.exception("advancing %s failed", state.key)
                failures[state.key] = failure_message(exc)
                continue
            outputs.setdefault(state.key, []).append(tokens[-1])
            if choice.sampling.generated == 1:
                first_tokens.append((state, now - state.request.arrival_time))
        with self._ledger.cv:  # the counters stats() copies, under its lock
            self._ledger.counters.generated_tokens += len(tokens)
            for owner, seconds in first_tokens:
                self._ledger.counters.time_to_first_token.observe(seconds)
                self._ledger.scheduler.policy.stats.observe_first_token(owner.scheduling, seconds)

    def _advance(
        self, state: RequestState, choice: Choice, place: int, sample: Sample, now: float
    ) -> NewToken:
        """Records a drawn token (at ``place``, its placeholder's) and decides the token-level end of
        the choice."""
        sampling, token = choice.sampling, sample.token_id
        sampling.record(token)
        choice.seq.tokens[place] = token
        finish, stop_token = self._stop(state, choice, token)
        if finish is not None:
            self._ledger.finish(choice.seq)
        return NewToken(choice.index, token, now, sample.logprobs, finish, stop_token)

    def _stop(
        self, state: RequestState, choice: Choice, token: int
    ) -> tuple[FinishReason | None, int | None]:
        """The token-level end a choice's new ``token`` makes, if any, and the stop token it was."""
        opts, sampling = state.request.sampling, choice.sampling
        if token in opts.stop_token_ids or (not opts.ignore_eos and token in self._eos):
            return FinishReason.STOP, token
        if sampling.constraint is not None and sampling.constraint.finished:
            return FinishReason.STOP, None  # the grammar allows nothing more
        if (
            sampling.generated >= opts.max_tokens
            or choice.seq.prompt_length + sampling.generated >= self._context_length
        ):
            return FinishReason.LENGTH, None
        return None, None

    def _verify(
        self, verified: list[tuple[Work, int]], logits: torch.Tensor, owners: Owners, outputs: Outputs
    ) -> None:
        """Rows that verified proposals draw their tokens position by position, each draw made
        exactly as a one-token step makes it (:meth:`sample`: the row's processing, penalties,
        masks, logprobs and seeded uniform for that output position), and
        :func:`worker.sampling.verify.accepted` keeps what they accept (docs/worker.md). Then each
        row commits what it kept."""
        assert self._speculation is not None
        rows = [owners[id(item.seq)] for item, _ in verified]

        def draw(live: list[int], picked: torch.Tensor) -> list[tuple[list[int], bool]]:
            chosen = [rows[row] for row in live]
            before = [choice.sampling.generated for _, choice in chosen]
            self.sample(chosen, picked, outputs)
            return [
                (
                    choice.sampling.output_token_ids[count:],
                    not (choice.finished or failed(outputs.get(state.key, []))),
                )
                for (state, choice), count in zip(chosen, before, strict=True)
            ]

        kept = accepted(
            logits, [first for _, first in verified], [item.proposals for item, _ in verified], draw
        )
        proposed = paused = 0
        for (item, _), (_, choice), taken in zip(verified, rows, kept, strict=True):
            proposed += len(item.proposals)
            paused += self._speculation.observe(
                choice.acceptance, len(item.proposals), taken, choice.sampling.generated
            )
            if not choice.finished:
                self._runner.accepted(item, taken)  # a hybrid model's state goes back to ``taken``
                with self._ledger.cv:
                    self._ledger.scheduler.committed(item, accepted=taken)
        with self._ledger.cv:
            counters = self._ledger.counters
            counters.speculative_proposed_tokens += proposed
            counters.speculative_accepted_tokens += sum(kept)
            counters.speculative_paused_rows += paused
        log.debug(
            "speculation: %d of %d proposed tokens accepted in %d rows", sum(kept), proposed, len(verified)
        )

    def publish(self, states: list[RequestState], outputs: Outputs) -> None:
        """Takes out the requests that finished and hands each request its outputs (paced by the
        stream interval)."""
        self._ledger.retire([s for s in states if s.done and not failed(outputs.get(s.key, []))])
        batches = []
        now = time.monotonic()
        for state in unique(states):
            out = outputs.get(state.key)
            # A preempted request's token read after it went back to the queue goes out at once,
            # as its kept-back ones did (:meth:`preempted`).
            if out is not None and not state.preempted:
                if state.request.stream_interval_s > 0:
                    out = sink.paced_by_time(state.pacing, out, state.request.stream_interval_s, now)
                elif self._stream_interval > 1:
                    out = sink.paced(state.pacing, out, self._stream_interval)
            if out is not None:
                batches.append((state.stream, out))
        if any(state.removed for state in states):  # a scrape after a request's end counts it
            self._published.refresh()
        sink.deliver(batches)

    def preempted(self, states: list[RequestState]) -> None:
        """Requests sent back to the queue: they keep their tokens and hear ``queued`` while waiting."""
        # Their kept-back tokens go out now, before the ``queued`` they hear next.
        sink.deliver([(s.stream, sink.paced(s.pacing, [], 1) or []) for s in states if s.pacing.held])
        self._ledger.preempted(states)
        log.info("preempted %d request(s) for KV blocks; they will be recomputed", len(states))
