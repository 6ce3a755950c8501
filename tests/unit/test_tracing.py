"""``--otlp-traces-endpoint``'s pieces (sluice/tracing.py, worker/service/tracing.py): off by default
without importing opentelemetry's SDK or exporter, the collector URL, the worker's phase spans."""

from __future__ import annotations

import ast
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from edge.app import create_app
from edge.settings import Settings
from edge.tracing import RequestTrace, started_ns
from sluice.tracing import Tracer, open_tracer, otlp_endpoint, traces_url
from worker.service.servicer import WorkerService
from worker.service.tracing import GenerateTrace, phases
from worker.types import Finished, FinishReason, Timings

_BLOCKED = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
_ROOT = Path(__file__).resolve().parents[2]


def test_no_module_imports_opentelemetry_at_its_top():
    """Imported lazily, inside the functions that run with the flag only."""
    for package in ("edge", "worker", "sluice"):
        for path in (_ROOT / package).rglob("*.py"):
            text = path.read_text()
            if "opentelemetry" not in text:
                continue
            for node in ast.parse(text).body:
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                assert not any(n.startswith("opentelemetry") for n in names), path


def test_without_the_flag_edge_and_worker_start_without_opentelemetry(monkeypatch):
    for name in _BLOCKED:  # an import of these now raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    create_app(Settings(workers=("127.0.0.1:1",)))
    assert WorkerService("w").tracer is None
    with pytest.raises(ImportError):  # the flag set: the blocked modules are imported
        create_app(Settings(workers=("127.0.0.1:1",), otlp_traces_endpoint="http://127.0.0.1:1"))


def test_open_tracer_without_an_endpoint_is_none():
    assert open_tracer("sluice-edge", None) is None
    assert open_tracer("sluice-edge", "") is None


def test_the_endpoint_setting_takes_http_urls_only():
    assert otlp_endpoint("") is None
    assert otlp_endpoint("https://otel.example:4318") == "https://otel.example:4318"
    for bad in ("collector:4318", "grpc://collector:4317", "http://"):
        with pytest.raises(ValueError, match="http:// or https://"):
            otlp_endpoint(bad)


def test_an_endpoint_without_a_path_gets_the_traces_path():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://otel.example/custom/traces") == "https://otel.example/custom/traces"


def _finished(queue: float, first: float, decode: float) -> Finished:
    return Finished(0, FinishReason.LENGTH, 4, timings=Timings(queue, first, decode))


def test_phases_cover_every_choice():
    choices = [_finished(0.1, 0.3, 1.0), _finished(0.2, 0.4, 2.0)]
    assert phases(choices) == [("queue", 0.0, 0.1), ("prefill", 0.1, 0.3), ("decode", 0.3, 2.4)]
    assert phases([]) == []


def _memory_tracer() -> tuple[Tracer, Any]:
    """A Tracer whose spans stay in memory (no collector)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    exporter = InMemorySpanExporter()
    tracer = Tracer.__new__(Tracer)
    tracer.provider = TracerProvider()
    tracer.provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer.tracer = tracer.provider.get_tracer("test")
    tracer._propagator = TraceContextTextMapPropagator()
    return tracer, exporter


def test_a_migration_is_a_child_span_of_the_request():
    tracer, exporter = _memory_tracer()
    parent = tracer.parent({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    trace = RequestTrace(tracer, tracer.tracer.start_span("POST /v1/chat/completions", context=parent))
    assert dict(trace.metadata)["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    trace.placed("a:1", "m", started_ns())
    trace.placed("b:2", "m", started_ns(), migration=True)
    trace.end("completed")
    trace.end("completed")  # once
    route, migrate, request = exporter.get_finished_spans()
    assert (route.name, migrate.name) == ("route", "migrate")
    assert migrate.parent.span_id == request.context.span_id
    assert migrate.attributes["sluice.worker.address"] == "b:2"
    assert request.attributes["sluice.worker.address"] == "b:2"  # where it ended
    assert request.parent.span_id == 0x00F067AA0BA902B7


def test_a_worker_call_cancelled_before_any_choice_finished_has_no_phases():
    tracer, exporter = _memory_tracer()
    trace = GenerateTrace(tracer, tracer.parent({}), "r1", time.monotonic(), "text_completion")
    trace.model = "m"
    trace.end("cancelled by the caller")
    (span,) = exporter.get_finished_spans()
    assert span.name == "text_completion m"
    assert span.attributes["gen_ai.operation.name"] == "text_completion"
    assert "gen_ai.usage.output_tokens" not in span.attributes
