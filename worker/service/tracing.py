"""The worker's spans (``--otlp-traces-endpoint``): one per Generate call, a child of the caller's
``traceparent``, with queue, prefill and decode children timed from the engine's Finished timings
and GenAI semantic-convention attributes. docs/observability.md, "Traces"."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.tracing import Tracer, wall_ns
from sluice.v1 import worker_pb2 as pb
from worker.types import Finished, SamplingOptions, Usage

SERVICE_NAME = "sluice-worker"
log = logging.getLogger("sluice.worker")


@dataclass
class GenerateTrace:
    """What one Generate call's spans say, gathered from its events; :meth:`end` sends them."""

    tracer: Tracer
    parent: Any
    request_id: str
    arrival: float  # time.monotonic() when the call arrived
    operation: str = "chat"  # gen_ai.operation.name: chat, or text_completion for a raw prompt
    model: str = ""
    sampling: SamplingOptions | None = None
    usage: Usage | None = None
    finished: list[Finished] = field(default_factory=list)

    def observe(self, event: object) -> None:
        """One engine event: its Finished timings and its Usage are kept."""
        if isinstance(event, Finished):
            self.finished.append(event)
        elif isinstance(event, Usage):
            self.usage = event

    def end(self, outcome: str) -> None:
        """The call's span and its phases, ending now with ``outcome``; a tracing failure is logged,
        never the call's."""
        try:
            self._export(outcome)
        except Exception:
            log.exception("request %s: its trace could not be recorded", self.request_id)

    def _export(self, outcome: str) -> None:
        now_s, now_ns = time.monotonic(), time.time_ns()
        start_ns = wall_ns(self.arrival, now_s, now_ns)
        span = self.tracer.tracer.start_span(
            f"{self.operation} {self.model}".strip(),
            context=self.parent,
            kind=_server_kind(),
            start_time=start_ns,
        )
        span.set_attributes(self._attributes(outcome))
        for name, begin_s, end_s in phases(self.finished):
            child = self.tracer.tracer.start_span(
                name, context=_in(span), start_time=start_ns + int(begin_s * 1e9)
            )
            child.end(end_time=start_ns + int(end_s * 1e9))
        span.end(end_time=now_ns)

    def _attributes(self, outcome: str) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.system": "sluice",
            "gen_ai.request.model": self.model,
            "gen_ai.response.model": self.model,
            "gen_ai.response.id": self.request_id,
            "sluice.request_id": self.request_id,
            "sluice.outcome": outcome,
        }
        if self.sampling is not None:
            attributes["gen_ai.request.max_tokens"] = self.sampling.max_tokens
            attributes["gen_ai.request.temperature"] = self.sampling.temperature
            attributes["gen_ai.request.top_p"] = self.sampling.top_p
        if self.usage is not None:
            attributes["gen_ai.usage.input_tokens"] = self.usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = self.usage.completion_tokens
        if self.finished:
            attributes["gen_ai.response.finish_reasons"] = [f.reason.value for f in self.finished]
        return attributes


def phases(finished: Sequence[Finished]) -> list[tuple[str, float, float]]:
    """(name, start, end) seconds after arrival of ``queue``, ``prefill`` and ``decode``, over all
    choices (earliest admission and first token, latest last token); none before a choice finished."""
    if not finished:
        return []
    queue = min(f.timings.queue_seconds for f in finished)
    first = max(queue, min(f.timings.time_to_first_token_seconds for f in finished))
    last = max(first, max(f.timings.time_to_first_token_seconds + f.timings.decode_seconds for f in finished))
    return [("queue", 0.0, queue), ("prefill", queue, first), ("decode", first, last)]


def begin(
    tracer: Tracer | None,
    metadata: Sequence[tuple[str, str | bytes]],
    request: pb.GenerateRequest,
    request_id: str,
    arrival: float,
) -> GenerateTrace | None:
    """A Generate call's (or stream's) trace (None without ``--otlp-traces-endpoint``), the child
    of the ``traceparent`` in its gRPC metadata (or its stream's)."""
    if tracer is None:
        return None
    carrier = {k: v for k, v in metadata if k in ("traceparent", "tracestate") and isinstance(v, str)}
    operation = "chat" if request.WhichOneof("input") == "chat" else "text_completion"
    return GenerateTrace(tracer, tracer.parent(carrier), request_id, arrival, operation)


def _server_kind() -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind.SERVER


def _in(span: Any) -> Any:
    from opentelemetry import trace

    return trace.set_span_in_context(span)
