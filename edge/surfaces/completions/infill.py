"""llama.cpp's ``POST /infill`` (code editors' fill-in-the-middle): its body becomes a completions
request with a ``suffix``, and the events llama.cpp's answer (``content``, ``stop``, ``stop_type``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, StrictBool

from edge.errors import EdgeError, InvalidRequestError
from edge.requests.limits import RequestLimits
from edge.requests.models import RequestModel, ResponseModel
from edge.requests.validation import bad, in_range, validate_body
from edge.streaming import sse
from edge.surfaces.answer import Framing
from edge.surfaces.completions.request import CompletionRequest, parse_completion_request
from edge.surfaces.shared.sampling import SamplingExtensions
from sluice.limits import INT32_MAX, PENALTY, REPETITION_PENALTY, TEMPERATURE, TOP_P
from sluice.v1 import worker_pb2

#: llama.cpp's stream: ``data:`` objects, the last with ``stop: true``; no ``[DONE]``.
LLAMA_CPP = Framing("infill", sse.data_frame, sse.error_frame, b"", b"")
# llama.cpp's field → the completions field it becomes (an error names the caller's field).
_RENAMES = {"max_tokens": "n_predict", "prompt": "input_prefix", "suffix": "input_suffix"}


class ExtraChunk(RequestModel):
    filename: str = ""
    text: str


class InfillRequest(SamplingExtensions):
    """A ``POST /infill`` body (llama.cpp's names, plus the sampling extensions every surface takes:
    ``top_k``, ``min_p``...; llama.cpp's ``repeat_penalty`` is ``repetition_penalty``); fields
    llama.cpp has and Sluice does not use (``cache_prompt``, ``samplers``...) are ignored."""

    model: str = ""
    input_prefix: str = Field(default="", description="The code before the gap.")
    input_suffix: str = Field(default="", description="The code after the gap.")
    input_extra: list[ExtraChunk] | None = Field(
        default=None, description="Context from other files, placed before the prefix (their texts)."
    )
    prompt: str = Field(default="", description="The start of the middle: appended to the prefix.")
    n_predict: int = Field(default=-1, ge=-1, le=INT32_MAX, description="Most tokens; -1 = no limit.")
    temperature: float | None = in_range(TEMPERATURE)
    top_p: float | None = in_range(TOP_P)
    seed: int | None = Field(default=None, ge=-1, le=2**64 - 1, description="-1 = random.")
    stop: list[str] | None = None
    presence_penalty: float | None = in_range(PENALTY)
    frequency_penalty: float | None = in_range(PENALTY)
    repeat_penalty: float | None = in_range(
        REPETITION_PENALTY, description="llama.cpp's name of repetition_penalty."
    )
    stream: StrictBool = False


class InfillResult(ResponseModel):
    """The answer (and the last streamed event); a streamed event before it has ``content`` and
    ``stop: false`` only."""

    content: str
    stop: bool
    model: str
    stop_type: str = Field(description="eos, limit (n_predict or the context) or word (a stop string).")
    stopping_word: str
    tokens_predicted: int
    tokens_evaluated: int
    tokens_cached: int


def parse_infill_request(body: Any, limits: RequestLimits | None = None) -> CompletionRequest:
    """The completions request an ``/infill`` body means: prompt = the extra context, the prefix and
    ``prompt``; suffix = ``input_suffix``. Raises a 400 naming the caller's field."""
    infill = validate_body(InfillRequest, body)
    extra = "".join(
        chunk.text if chunk.text.endswith("\n") else chunk.text + "\n" for chunk in infill.input_extra or ()
    )
    completion: dict[str, Any] = {
        "model": infill.model,
        "prompt": extra + infill.input_prefix + infill.prompt,
        "suffix": infill.input_suffix,
        "max_tokens": infill.n_predict if infill.n_predict >= 0 else None,
        "stream": infill.stream,
        **infill.given_extensions(),
    }
    if infill.repeat_penalty is not None:
        if infill.repetition_penalty is not None:
            raise bad("repeat_penalty", "give repeat_penalty or repetition_penalty, not both")
        completion["repetition_penalty"] = infill.repeat_penalty
    for name in ("temperature", "top_p", "stop", "presence_penalty", "frequency_penalty"):
        if getattr(infill, name) is not None:
            completion[name] = getattr(infill, name)
    if infill.seed is not None and infill.seed >= 0:
        completion["seed"] = infill.seed
    try:
        return parse_completion_request(completion, limits)
    except InvalidRequestError as error:
        raise infill_error(error) from None


def infill_error(error: InvalidRequestError) -> InvalidRequestError:
    """``error`` (the edge's or the worker's, about the completions request) naming the caller's
    field: ``max_tokens`` is ``n_predict``, ``suffix`` is ``input_suffix``..."""
    param = error.param or ""
    renamed = _RENAMES.get(param)
    if renamed is None:
        return error
    message = error.message.replace(f"'{param}'", f"'{renamed}'")
    named = InvalidRequestError(message, param=renamed, code=error.code)
    named.worker_id = error.worker_id
    return named


@dataclass
class InfillTranslator:
    """One ``/infill`` call's events → llama.cpp's answer: ``{"content", "stop": false}`` per delta
    when streamed, then (or as the whole answer) an :class:`InfillResult`."""

    model: str
    _text: list[str] = field(default_factory=list)
    _finished: worker_pb2.Finished | None = None
    _usage: worker_pb2.Usage | None = None

    def _note(self, event: worker_pb2.GenerateResponse) -> str:
        kind = event.WhichOneof("event")
        if kind == "content":
            self._text.append(event.content.text)
            return event.content.text
        if kind == "finished":
            self._finished = event.finished
        elif kind == "usage":
            self._usage = event.usage
        elif kind == "started":
            self.model = event.started.model or self.model
        return ""

    def on_event(self, call: int, event: worker_pb2.GenerateResponse) -> list[dict[str, Any]]:
        text = self._note(event)
        return [{"content": text, "stop": False}] if text else []

    def finish(self) -> list[dict[str, Any]]:
        return [self._final("")]

    def on_error(self, error: EdgeError) -> list[dict[str, Any]]:
        return [error.payload()]

    def add(self, call: int, event: worker_pb2.GenerateResponse) -> None:
        self._note(event)

    def result(self) -> dict[str, Any]:
        return self._final("".join(self._text))

    def _final(self, content: str) -> dict[str, Any]:
        finished, usage = self._finished, self._usage
        stop_type = "eos"
        if finished is not None and finished.reason == worker_pb2.LENGTH:
            stop_type = "limit"
        elif finished is not None and finished.matched_stop:
            stop_type = "word"
        return {
            "content": content,
            "stop": True,
            "model": self.model,
            "stop_type": stop_type,
            "stopping_word": finished.matched_stop if finished is not None else "",
            "tokens_predicted": usage.completion_tokens if usage is not None else 0,
            "tokens_evaluated": usage.prompt_tokens if usage is not None else 0,
            "tokens_cached": usage.cached_tokens if usage is not None else 0,
        }
