"""OpenTelemetry traces (``--otlp-traces-endpoint``) from a real edge and a real fake-token worker
into an OTLP/HTTP collector run by the test: a client's ``traceparent`` is the parent of the edge's
span, whose own ``traceparent`` reaches the worker in the gRPC metadata."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


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


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, str]]:
    spans = Collector()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(spans))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield spans, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def edge(collector, model_cache, tmp_path_factory) -> Iterator[EdgeProcess]:
    endpoint = ["--otlp-traces-endpoint", collector[1]]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the processes export within 50 ms, not 5 s
        with (
            WorkerProcess(
                cache_dir=model_cache,
                log_dir=tmp_path_factory.mktemp("worker-log"),
                extra=["--fake-tokens", *endpoint],
            ) as worker,
            EdgeProcess(
                [worker.address], log_dir=tmp_path_factory.mktemp("edge-log"), extra=endpoint
            ) as edge,
        ):
            yield edge


def chat(edge: EdgeProcess, trace_id: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the town."}], **extra}
    traceparent = f"00-{trace_id}-{CLIENT_SPAN_ID}-01"
    return httpx.post(
        f"{edge.base_url}/v1/chat/completions", json=body, headers={"traceparent": traceparent}, timeout=60
    )


def by_name(spans: list[dict[str, Any]], service: str) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in spans if s["service"] == service}


def test_a_chat_completion_is_traced_through_edge_and_worker(edge, collector):
    response = chat(edge, TRACE_ID, max_tokens=12)
    assert response.status_code == 200
    usage = response.json()["usage"]
    spans = collector[0].wait_for(TRACE_ID, 2, 4)  # request and route; the call and its 3 phases
    edge_spans, worker_spans = by_name(spans, "sluice-edge"), by_name(spans, "sluice-worker")
    request = edge_spans["POST /v1/chat/completions"]
    assert request["parent"] == CLIENT_SPAN_ID  # the client's traceparent
    assert request["attributes"]["http.response.status_code"] == 200
    assert request["attributes"]["gen_ai.request.model"] == MODEL
    assert edge_spans["route"]["parent"] == request["span_id"]
    call = worker_spans[f"chat {MODEL}"]
    assert call["parent"] == request["span_id"]  # the edge's traceparent, in the gRPC metadata
    assert call["attributes"]["gen_ai.request.model"] == MODEL
    assert call["attributes"]["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert call["attributes"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 12
    assert call["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    phases = [worker_spans[name] for name in ("queue", "prefill", "decode")]
    assert all(p["parent"] == call["span_id"] for p in phases)
    assert call["start"] <= phases[0]["start"] <= phases[0]["end"] <= phases[1]["start"] + 1
    assert phases[1]["end"] <= phases[2]["start"] + 1 and phases[2]["end"] <= call["end"] + 1


def test_a_streamed_request_span_covers_the_stream(edge, collector):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    response = chat(edge, trace_id, max_tokens=8, stream=True)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    spans = collector[0].wait_for(trace_id, 2, 4)
    request = by_name(spans, "sluice-edge")["POST /v1/chat/completions"]
    assert request["attributes"]["sluice.outcome"] == "completed"
    call = by_name(spans, "sluice-worker")[f"chat {MODEL}"]
    assert call["attributes"]["gen_ai.usage.output_tokens"] == 8
    assert request["end"] >= call["end"]  # ended with the stream, not when the handler returned
