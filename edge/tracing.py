"""The edge's spans (``--otlp-traces-endpoint``): one per API request, the child of the client's W3C
``traceparent``, with a child per routing and per migration; its ``traceparent`` goes to the
worker in the call's gRPC metadata. docs/observability.md, "Traces"."""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any

from quart import request
from quart.wrappers import Response

from edge.auth import PROTECTED_PREFIXES
from edge.http import current_request_id
from sluice.tracing import Tracer

SERVICE_NAME = "sluice-edge"


class RequestTrace:
    """One API request's span: its children for routing and migration, its headers for the worker."""

    def __init__(self, tracer: Tracer, span: Any) -> None:
        self.tracer, self.span = tracer, span
        self.metadata: tuple[tuple[str, str], ...] = tuple(tracer.headers(span).items())
        self.ended = False
        self.streamed = False  # a stream answers: its end ends the span

    def placed(self, worker_address: str, model: str, started_ns: int, *, migration: bool = False) -> None:
        """A ``route`` (or ``migrate``) child span from ``started_ns`` to now, to ``worker_address``."""
        from opentelemetry import trace

        child = self.tracer.tracer.start_span(
            "migrate" if migration else "route",
            context=trace.set_span_in_context(self.span),
            start_time=started_ns,
            attributes={"sluice.worker.address": worker_address},
        )
        child.end()
        self.span.set_attributes({"sluice.worker.address": worker_address, "gen_ai.request.model": model})

    def end(self, outcome: str) -> None:
        """Ends the span (once) with how the request ended."""
        if not self.ended:
            self.ended = True
            self.span.set_attribute("sluice.outcome", outcome)
            self.span.end()


#: The current request's trace (set by :meth:`EdgeTracing.begin`, read by the worker calls).
_current: ContextVar[RequestTrace | None] = ContextVar("sluice_request_trace", default=None)


def current_trace() -> RequestTrace | None:
    """The current request's trace; None without ``--otlp-traces-endpoint`` or outside an API request."""
    return _current.get()


class EdgeTracing:
    """The Quart hooks of ``--otlp-traces-endpoint``: :meth:`begin` before, :meth:`after` after a request."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    async def begin(self) -> None:
        """Starts an API request's span, the child of the client's ``traceparent`` if it sent one."""
        if not request.path.startswith(PROTECTED_PREFIXES):
            return
        from opentelemetry.trace import SpanKind

        carrier = {
            k.lower(): v for k, v in request.headers.items() if k.lower() in ("traceparent", "tracestate")
        }
        span = self.tracer.tracer.start_span(
            f"{request.method} {request.path}",
            context=self.tracer.parent(carrier),
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": request.method,
                "url.path": request.path,
                "sluice.request_id": current_request_id(),
            },
        )
        _current.set(RequestTrace(self.tracer, span))

    async def after(self, response: Response) -> Response:
        """Records the status; ends the span unless a stream answers (its end ends the span:
        ``sse_response``'s close hook in edge/surfaces/generation.py)."""
        trace = current_trace()
        if trace is None:
            return response
        trace.span.set_attribute("http.response.status_code", response.status_code)
        if not trace.streamed:
            trace.end("completed" if response.status_code < 400 else "error")
        return response


def started_ns() -> int:
    """Now, as span times are written (epoch nanoseconds)."""
    return time.time_ns()
