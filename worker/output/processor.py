"""Text-level output of one request: the engine core's tokens → the events callers see.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from sluice.coalesce import joined, mergeable
from worker.output.choice_output import ChoiceOutput
from worker.output.detokenizer import Decoder, IncrementalDetokenizer, TokenTexts
from worker.output.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    from worker.config import WorkerConfig
from worker.types import (
    ChoiceEnded,
    ContentDelta,
    CoreFailure,
    CoreOutput,
    Dequeued,
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    NewToken,
    Progress,
    PromptLogprobs,
    PromptScored,
    ReasoningDelta,
    RefusalDelta,
    SampledLogprobs,
    Timings,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)

# The deltas the shared merge rule applies to, by their event name on the wire.
_DELTA_KINDS: dict[type, str] = {
    ContentDelta: "content",
    ReasoningDelta: "reasoning",
    RefusalDelta: "refusal",
    ToolCallDelta: "tool_call",
}


@dataclass(frozen=True)
class TextRules:
    """Worker-wide text rules: a blocked phrase ends the choice with a refusal and "content_filter"."""

    blocked_phrases: tuple[str, ...] = ()
    refusal_message: str = "I can't help with that."

    @classmethod
    def of(cls, config: WorkerConfig) -> TextRules:
        """The rules ``--blocked-phrases`` and ``--refusal-message`` set."""
        return cls(tuple(config.blocked_phrases), config.refusal_message)


@dataclass
class _ChoiceText:
    index: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    output: ChoiceOutput
    generated: int = 0
    reasoning_tokens: int = 0
    finished: bool = False
    # Resumed after the earlier call already sent this choice's finish tail (see _prime): the
    # choice ends at its next end (or token) without sending a tail again; ``tail_stop`` is the stop
    # string that tail matched, if any.
    tail_sent: bool = False
    tail_stop: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class ProcessorOutput:
    events: list[Event] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)  # choices ended here by text; the core drops them
    done: bool = False  # the request's last event (Usage or Failed) is in ``events``


class RequestOutputProcessor:
    """One per request. ``process`` each batch of core outputs in order; ``usage`` at any time."""

    def __init__(
        self, request: GenerationRequest, tokenizer: Decoder, token_texts: TokenTexts, rules: TextRules
    ):
        self._request = request
        self._texts = token_texts
        self._rules = rules
        sampling = request.sampling
        stops = sampling.stop + rules.blocked_phrases
        # A blocked phrase is never shown, even when the caller's stop strings are kept.
        kept = tuple(s for s in sampling.stop if s not in rules.blocked_phrases)
        skip_special = (
            sampling.skip_special_tokens
            if sampling.skip_special_tokens is not None
            else not request.output.keep_special_tokens
        )
        self._choices = [
            _ChoiceText(
                index=i,
                detokenizer=IncrementalDetokenizer(tokenizer, request.prompt_token_ids, skip_special),
                stops=StopStringMatcher(stops, kept if sampling.include_stop_str_in_output else ()),
                output=ChoiceOutput(i, request.output),
            )
            for i in range(request.sampling.n)
        ]
        self._dequeued_time: float | None = None
        self._cached_tokens = 0
        self._done = False
        # A resumed request's events that the earlier call never delivered (see ``_prime``); sent
        # with the first batch of core outputs.
        self._resumed_events: list[Event] = []
        if request.resumed_token_ids:
            self._prime(request.resumed_token_ids)

    @property
    def ended_while_priming(self) -> bool:
        """Every choice already ended within the resumed tokens (a stop string or blocked phrase in
        them): the core has nothing to generate."""
        return bool(self._request.resumed_token_ids) and all(c.finished for c in self._choices)

    def _prime(self, token_ids: tuple[int, ...]) -> None:
        """Feeds a resumed request's already-delivered tokens through choice 0's text pipeline
        (detokenizer, stop strings, parsers, counts) without sending what they produced again.

        The earlier call delivered every event up to and including the last delta that carried ids
        (ids travel on the last delta of their tokens); the same tokens produce the same events here,
        so those are dropped and only what would have followed that delta (a refusal, a finish tail,
        ``finished``) is kept for sending. Times are left unset: the first token drawn here starts
        this call's timings."""
        out = ProcessorOutput()
        for token_id in token_ids:
            self._token(NewToken(0, token_id, self._request.arrival_time), out)
            if self._choices[0].finished:
                break
        choice = self._choices[0]
        choice.first_token_time = choice.last_token_time = None
        if not choice.finished and choice.output.holds_token_ids:
            # The last delivered delta was the one a finish puts the held-back tokens on: the earlier
            # call had ended this choice and sent its tail (only ``finished`` was lost). Rebuild that
            # tail to know its stop string; it was delivered, so it is not sent again.
            tail, choice.tail_stop = choice.stops.push(choice.detokenizer.flush())
            if choice.tail_stop is None:
                tail += choice.stops.flush()
            out.events += choice.output.finish(tail)
            choice.tail_sent = True
        last_with_ids = max((i for i, e in enumerate(out.events) if getattr(e, "token_ids", ())), default=-1)
        # Non-empty only when the choice ended within these tokens (Engine.submit then runs nothing).
        self._resumed_events = out.events[last_with_ids + 1 :]

    @property
    def done(self) -> bool:
        return self._done

    def usage(self) -> Usage:
        prompt_tokens = len(self._request.prompt_token_ids)
        return Usage(
            prompt_tokens,
            sum(c.generated for c in self._choices),
            # A resumed request's cache hit may reach into its resumed tokens; usage counts the prompt.
            cached_tokens=min(self._cached_tokens, prompt_tokens),
            reasoning_tokens=sum(c.reasoning_tokens for c in self._choices),
        )

    def process(self, outputs: Iterable[CoreOutput]) -> ProcessorOutput:
        out = ProcessorOutput()
        if self._resumed_events:
            out.events += self._resumed_events
            self._resumed_events = []
            if all(c.finished for c in self._choices):
                out.events.append(self.usage())
                self._done = out.done = True
        for item in outputs:
            if self._done:
                break
            if isinstance(item, NewToken):
                self._token(item, out)
            elif isinstance(item, Progress):
                out.events.append(item)
            elif isinstance(item, Dequeued):
                if self._dequeued_time is None:
                    self._dequeued_time, self._cached_tokens = item.time, item.cached_tokens
                else:  # scored first, then prefilled: the prefill's cache hit counts
                    self._cached_tokens = item.cached_tokens
            elif isinstance(item, PromptScored):
                logprobs = [self._logprob(entry) for entry in item.entries]
                first = self._request.prompt_token_ids[0]
                text, raw = self._texts(first)
                scored = tuple(lp for lp in logprobs if lp is not None)
                out.events.append(PromptLogprobs(scored, first, text, raw))
            elif isinstance(item, ChoiceEnded):
                choice = self._choices[item.choice_index]
                if not choice.finished:
                    self._finish(choice, item.reason, out)
            elif isinstance(item, CoreFailure):
                out.events.append(Failed(item.message, self.usage()))
                self._done = out.done = True
            if self._done:
                continue
            if type(item) is NewToken and not self._choices[item.choice_index].finished:
                continue  # the common case, without looking at every choice: one is still open
            if all(c.finished for c in self._choices):
                out.events.append(self.usage())
                self._done = out.done = True
        return out

    def _token(self, item: NewToken, out: ProcessorOutput) -> None:
        choice = self._choices[item.choice_index]
        if choice.finished:
            return  # drawn after a stop string ended the choice: never shown, never counted
        if choice.first_token_time is None:
            choice.first_token_time = item.time
        choice.last_token_time = item.time
        choice.generated += 1
        if item.stop_token is not None:
            if self._request.sampling.include_stop_str_in_output:
                # vLLM's rule: the stop token's text is kept too (none for a skipped special token).
                text, _ = choice.stops.push(choice.detokenizer.push(item.token_id))
                out.events += choice.output.push(text)
            self._finish(choice, FinishReason.STOP, out, stop_token=item.stop_token)
            return
        if choice.tail_sent:
            # The earlier call ended here with a stop token; a sampled request drew another token
            # this time: the choice still ends, as it did for the caller.
            self._finish(choice, FinishReason.STOP, out)
            out.stopped.append(choice.index)
            return
        if choice.output.thinking:
            choice.reasoning_tokens += 1
        ids = item.token_id if self._request.return_token_ids or self._request.resumed_token_ids else None
        choice.output.add_token(ids, self._logprob(item.logprobs))
        text, matched = choice.stops.push(choice.detokenizer.push(item.token_id))
        out.events += choice.output.push(text)
        if matched is not None:
            if matched in self._rules.blocked_phrases and matched not in self._request.sampling.stop:
                out.events.append(RefusalDelta(choice.index, self._rules.refusal_message))
                self._finish(choice, FinishReason.CONTENT_FILTER, out, stop_string=matched)
            else:
                self._finish(choice, FinishReason.STOP, out, stop_string=matched)
            out.stopped.append(choice.index)
        elif item.finish is not None:
            self._finish(choice, item.finish, out)

    def _logprob(self, sampled: SampledLogprobs | None) -> TokenLogprob | None:
        if sampled is None:
            return None
        text, raw = self._texts(sampled.token_id)
        top = []
        for alt, value in zip(sampled.top_ids, sampled.top_logprobs, strict=True):
            alt_text, alt_raw = self._texts(alt)
            top.append(TopLogprob(alt, alt_text, value, alt_raw))
        return TokenLogprob(sampled.token_id, text, sampled.logprob, raw, tuple(top))

    def _finish(
        self,
        choice: _ChoiceText,
        reason: FinishReason,
        out: ProcessorOutput,
        *,
        stop_string: str = "",
        stop_token: int | None = None,
    ) -> None:
        if choice.tail_sent:  # resumed after the earlier call sent the tail: only `finished` is left
            if choice.tail_stop is not None:
                reason, stop_string, stop_token = FinishReason.STOP, choice.tail_stop, None
        else:
            tail = ""
            if not stop_string:
                # Release what the detokenizer and the stop matcher still hold; the tail itself may
                # complete a stop string.
                tail, matched = choice.stops.push(choice.detokenizer.flush())
                if matched is not None:
                    reason, stop_string, stop_token = FinishReason.STOP, matched, None
                else:
                    tail += choice.stops.flush()
            out.events += choice.output.finish(tail)
        if reason is FinishReason.STOP and choice.output.tool_calls:
            reason = FinishReason.TOOL_CALLS
        if reason is FinishReason.CONTENT_FILTER:
            stop_string = ""  # the blocked phrase is not shown to the caller
        choice.finished = True
        arrival = self._request.arrival_time
        first = choice.first_token_time or arrival
        timings = Timings(
            queue_seconds=max(0.0, (self._dequeued_time or arrival) - arrival),
            time_to_first_token_seconds=max(0.0, first - arrival),
            decode_seconds=max(0.0, (choice.last_token_time or first) - first),
        )
        out.events.append(Finished(choice.index, reason, choice.generated, stop_string, stop_token, timings))


def coalesce(events: Sequence[Event]) -> list[Event]:
    """Merges each run of deltas that the shared rule lets merge (``sluice.coalesce``: one choice's
    content, reasoning, refusal or tool-call arguments) into one delta: what a consumer that fell
    behind by several steps receives as one message. Order and every other event are kept."""
    if len(events) < 2:
        return list(events)  # a step's usual lot: nothing to merge
    merged: list[Event] = []
    for event in events:
        kind = _DELTA_KINDS.get(type(event))
        last = merged[-1] if merged else None
        if kind is not None and type(last) is type(event) and mergeable(kind, last, event):
            merged[-1] = replace(last, **joined(kind, last, event))
        else:
            merged.append(event)
    return merged
