"""An OTLP/HTTP trace collector for the tests: the spans the processes export, by service, with a
condition to wait on."""

from __future__ import annotations

import contextlib
import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class Collector:
    """The spans the processes exported: (service name, span name, trace id, span id, parent span
    id, attributes), with a condition to wait on."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.changed = threading.Condition()

    def add(self, body: bytes) -> None:
        export = ExportTraceServiceRequest.FromString(body)
        with self.changed:
            for resource_spans in export.resource_spans:
                service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(_span(service["service.name"], span))
            self.changed.notify_all()

    def wait_for(self, trace_id: str, edge: int, worker: int) -> list[dict[str, Any]]:
        """The spans of ``trace_id`` once the edge sent ``edge`` and the worker ``worker`` of them
        (30 s at most)."""

        def of_trace() -> list[dict[str, Any]]:
            return [s for s in self.spans if s["trace_id"] == trace_id]

        with self.changed:

            def arrived() -> bool:
                services = [s["service"] for s in of_trace()]
                return services.count("sluice-edge") >= edge and services.count("sluice-worker") >= worker

            self.changed.wait_for(arrived, 30)
            return of_trace()


def _span(service: str, span: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    for attribute in span.attributes:
        value = attribute.value
        kind = value.WhichOneof("value")
        attributes[attribute.key] = (
            [v.string_value for v in value.array_value.values]
            if kind == "array_value"
            else getattr(value, kind)
        )
    return {
        "service": service,
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent": span.parent_span_id.hex(),
        "start": span.start_time_unix_nano,
        "end": span.end_time_unix_nano,
        "attributes": attributes,
    }


def _handler(collector: Collector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            assert self.path == "/v1/traces"
            collector.add(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextlib.contextmanager
def otlp_collector() -> Iterator[tuple[Collector, str]]:
    """A collector served on a free port: it and its base URL (``--otlp-traces-endpoint``)."""
    spans = Collector()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(spans))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield spans, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def by_name(spans: list[dict[str, Any]], service: str) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in spans if s["service"] == service}
