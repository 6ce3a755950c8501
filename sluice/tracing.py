"""OpenTelemetry traces (``--otlp-traces-endpoint``), shared by edge and worker: the exporter set-up
and W3C ``traceparent`` handling. opentelemetry is imported only when :func:`open_tracer` runs, so
a process without the flag neither imports nor pays for it. docs/observability.md, "Traces"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

#: The path OTLP/HTTP collectors take traces on; an endpoint given without a path gets it.
TRACES_PATH = "/v1/traces"


def otlp_endpoint(raw: str) -> str | None:
    """The ``--otlp-traces-endpoint`` setting: an http(s) URL with a host, or "" (None: off)."""
    if not raw:
        return None
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL of an OTLP collector, got {raw!r}")
    return raw


def traces_url(endpoint: str) -> str:
    """``endpoint`` as the exporter's URL: ``http://host:4318`` becomes ``http://host:4318/v1/traces``."""
    return endpoint if urlsplit(endpoint).path not in ("", "/") else endpoint.rstrip("/") + TRACES_PATH


class Tracer:
    """One process's tracer: spans batched to the OTLP/HTTP (protobuf) ``endpoint`` as
    ``service_name``; :meth:`close` sends what is left."""

    def __init__(self, service_name: str, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer: Any = self.provider.get_tracer("sluice")
        self._propagator = TraceContextTextMapPropagator()

    def parent(self, carrier: Mapping[str, str]) -> Any:
        """The context of a W3C ``traceparent`` (and ``tracestate``) in ``carrier`` (lower-case
        keys); an empty context (a new trace) when it has none or a malformed one."""
        return self._propagator.extract(carrier)

    def headers(self, span: Any) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span`` as the parent of the next hop."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def close(self) -> None:
        """Exports the spans still batched and stops the exporter."""
        self.provider.shutdown()


def open_tracer(service_name: str, endpoint: str | None) -> Tracer | None:
    """The process's tracer, or None (and no import of opentelemetry) when ``endpoint`` is unset."""
    return Tracer(service_name, endpoint) if endpoint else None


def wall_ns(monotonic_s: float, now_monotonic_s: float, now_wall_ns: int) -> int:
    """A ``time.monotonic()`` instant as epoch nanoseconds, against a (monotonic, wall) pair read together."""
    return now_wall_ns - int((now_monotonic_s - monotonic_s) * 1e9)
