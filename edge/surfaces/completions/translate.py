"""``/v1/completions``: a request → one worker request per prompt, and the calls' events → one
``text_completion`` (chunks, or one body) whose ``k * n`` choices are ordered prompt by prompt.

Legacy logprobs and ``echo`` follow OpenAI's rules (docs/edge-internals.md, "Completions translation").
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

from edge.surfaces.completions.request import CompletionRequest
from edge.surfaces.shared.chunks import ChunkStream
from edge.surfaces.shared.finish import finish_reason_name
from edge.surfaces.shared.worker_request import sampling_params
from sluice.v1 import worker_pb2


def to_generate_requests(request: CompletionRequest, request_id: str) -> list[worker_pb2.GenerateRequest]:
    """One worker request per prompt, in prompt order; every accepted field lands in each.

    With several prompts, call ``i`` carries the request id ``<request_id>.<i>``
    so worker logs tell the calls apart.
    """
    requests = []
    structured = request.structured_form()
    for index, prompt in enumerate(request.prompt):
        sampling = sampling_params(request, max_tokens=request.max_tokens)
        if request.logprobs is not None:
            sampling.logprobs = request.logprobs
        if request.echo and (request.logprobs is not None or request.max_tokens == 0):
            # The worker scores the prompt; max_tokens 0 is allowed only then.
            sampling.prompt_logprobs = request.logprobs or 0
        proto = worker_pb2.GenerateRequest(
            request_id=request_id if len(request.prompt) == 1 else f"{request_id}.{index}",
            model=request.model,
            sampling=sampling,
            echo_prompt=request.echo,
            return_token_ids=request.stream and request.continuous_usage,
            user=request.user or "",
            priority=request.priority or 0,
        )
        if structured is not None:
            proto.response_format.CopyFrom(structured.proto)
        if isinstance(prompt, str):
            proto.prompt.text = prompt
        else:
            proto.prompt.token_ids.ids.extend(prompt)
        proto.prompt.suffix = request.suffix or ""
        requests.append(proto)
    return requests


class LegacyLogprobs:
    """Legacy logprobs of one choice, built incrementally (one instance per choice).

    ``text_offset`` is the character offset of each token in the choice's
    text (after ``base_offset`` characters of echoed prompt). A token holding
    part of a UTF-8 character starts at the offset where that character
    starts. ``top_logprobs`` maps token text to logprob for the requested
    alternatives plus the sampled token (so up to ``logprobs + 1`` entries, as
    OpenAI documents); two alternatives with the same text keep the higher.
    """

    def __init__(self, base_offset: int = 0) -> None:
        self._offset = base_offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def prompt_entries(self, scored: worker_pb2.PromptLogprobs) -> dict[str, Any]:
        """The legacy object for the echoed prompt's tokens: the first with ``null`` logprobs (OpenAI's
        legacy format), the rest as for generated tokens. Offsets restart at 0: the prompt is the start
        of the echoed text."""
        self._offset = 0
        self._decoder.reset()
        first_offset = self._offset
        self._offset += len(self._decoder.decode(scored.first_token_bytes))
        rest = self.entries(scored.logprobs)
        return {
            "tokens": [scored.first_token, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [first_offset, *rest["text_offset"]],
        }

    def entries(self, logprobs: Any) -> dict[str, Any]:
        """The legacy object for the tokens of one delta (``logprobs``: ``TokenLogprob`` entries)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for lp in logprobs:
            tokens.append(lp.token)
            token_logprobs.append(lp.logprob)
            alternatives: dict[str, float] = {}
            for alternative in lp.top_logprobs:
                alternatives.setdefault(alternative.token, alternative.logprob)
            alternatives.setdefault(lp.token, lp.logprob)
            top.append(alternatives)
            offsets.append(self._offset)
            self._offset += len(self._decoder.decode(lp.bytes))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }


def merge_legacy(into: dict[str, Any], more: dict[str, Any]) -> None:
    """Appends the lists of one legacy logprobs object to another."""
    for key, values in more.items():
        into[key].extend(values)


@dataclass
class _Choices:
    """Maps (call, worker choice) to the response's choice index and keeps per-choice logprobs."""

    n: int
    logprobs: bool
    echo: bool
    states: dict[int, LegacyLogprobs] = field(default_factory=dict)
    prompts: dict[int, str] = field(default_factory=dict)

    def index(self, call: int, choice: int) -> int:
        return call * self.n + choice

    def started(self, call: int, started: worker_pb2.Started) -> list[int]:
        """Records a call's start; returns its choice indexes."""
        if self.echo:
            self.prompts[call] = started.prompt_text
        indexes = [self.index(call, c) for c in range(max(1, started.n))]
        for index in indexes:
            self.states[index] = LegacyLogprobs(len(self.echoed(call)))
        return indexes

    def echoed(self, call: int) -> str:
        return self.prompts.get(call, "")

    def legacy(self, index: int, logprobs: Any) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return self.states.setdefault(index, LegacyLogprobs()).entries(logprobs)

    def prompt_legacy(self, call: int, scored: worker_pb2.PromptLogprobs) -> list[tuple[int, dict[str, Any]]]:
        """The echoed prompt's legacy logprobs for each choice of a call (none unless logprobs and echo)."""
        if not (self.logprobs and self.echo):
            return []
        indexes = [self.index(call, c) for c in range(self.n)]
        return [(i, self.states.setdefault(i, LegacyLogprobs()).prompt_entries(scored)) for i in indexes]


@dataclass
class _TextChoice:
    text: list[str] = field(default_factory=list)
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


@dataclass
class CompletionsTranslator(ChunkStream):
    """Turns the events of a completions request's calls (each with its call index) into
    ``text_completion`` chunks (:meth:`on_event`, then :meth:`finish`) or one body (:meth:`add`,
    then :meth:`result`). Usage keys follow the chat rules.
    """

    n: int = 1
    echo: bool = False
    _choices: _Choices = field(init=False)
    _texts: dict[int, _TextChoice] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._choices = _Choices(self.n, self.logprobs, self.echo)
        self._open_envelope("text_completion", system_fingerprint=None)

    # ------------------------------------------------------------ stream

    def on_event(self, call: int, event: worker_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """Chunks for one event of call ``call``, in wire order (possibly none)."""
        kind = event.WhichOneof("event")
        self.usage.on_event(call, event, kind)
        if kind == "content":  # the most frequent event first
            delta = event.content
            text = delta.text
            if not text and not delta.logprobs:
                return []
            index = self._choices.index(call, delta.choice_index)
            return [self._chunk(index, text, self._choices.legacy(index, delta.logprobs))]
        if kind == "started":
            indexes = self._choices.started(call, event.started)
            prompt = self._choices.echoed(call)
            return [self._chunk(i, prompt) for i in indexes] if self.echo and prompt else []
        if kind == "finished":
            index = self._choices.index(call, event.finished.choice_index)
            return [self._chunk(index, "", None, finish_reason_name(event.finished.reason))]
        if kind == "prompt_logprobs":  # with echo: the prompt's logprobs, in a chunk of no new text
            return [
                self._chunk(i, "", legacy)
                for i, legacy in self._choices.prompt_legacy(call, event.prompt_logprobs)
            ]
        # Usage is summed in finish(); raw prompts produce no reasoning, refusal or tool calls.
        return []

    def _chunk(
        self, index: int, text: str, logprobs: dict[str, Any] | None = None, finish_reason: str | None = None
    ) -> dict[str, Any]:
        return self._envelope.chunk(
            [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}]
        )

    # ------------------------------------------------------------ result

    def add(self, call: int, event: worker_pb2.GenerateResponse) -> None:
        """Records one event of call ``call`` for the non-streamed answer (:meth:`result`)."""
        self.usage.on_event(call, event)
        kind = event.WhichOneof("event")
        if kind == "started":
            for index in self._choices.started(call, event.started):
                state = self._text(index)
                state.text.append(self._choices.echoed(call))
        elif kind == "content":
            delta = event.content
            index = self._choices.index(call, delta.choice_index)
            state = self._text(index)
            state.text.append(delta.text)
            legacy = self._choices.legacy(index, delta.logprobs)
            if legacy is not None and state.logprobs is not None:
                merge_legacy(state.logprobs, legacy)
        elif kind == "finished":
            index = self._choices.index(call, event.finished.choice_index)
            self._text(index).finish_reason = finish_reason_name(event.finished.reason)
        elif kind == "prompt_logprobs":
            for index, legacy in self._choices.prompt_legacy(call, event.prompt_logprobs):
                state = self._text(index)
                if state.logprobs is not None:
                    merge_legacy(state.logprobs, legacy)

    def _text(self, index: int) -> _TextChoice:
        state = self._texts.setdefault(index, _TextChoice())
        if self.logprobs and state.logprobs is None:
            state.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return state

    def result(self) -> dict[str, Any]:
        """The ``text_completion`` dict (choices ordered by index)."""
        choices = [
            {
                "text": "".join(state.text),
                "index": index,
                "logprobs": state.logprobs,
                "finish_reason": state.finish_reason or "stop",
            }
            for index, state in sorted(self._texts.items())
        ]
        return self._body("text_completion", choices, system_fingerprint=None)
