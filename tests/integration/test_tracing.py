"""OpenTelemetry traces (``--otlp-traces-endpoint``) from a real edge and a real fake-token worker
into an OTLP/HTTP collector run by the test: a client's ``traceparent`` is the parent of the edge's
span, whose own ``traceparent`` reaches the worker in the gRPC metadata."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.otlp import Collector, by_name, otlp_collector
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, str]]:
    with otlp_collector() as served:
        yield served


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
