"""Edge /metrics: the exposition helpers, the stream watcher, and the endpoint on a served edge."""

from __future__ import annotations

import re

import grpc
import httpx
import pytest
from edge_fakes import (
    CHAT_BODY,
    Abort,
    FakeWorker,
    Hang,
    content,
    dead_address,
    finished,
    run,
    running_edge,
    running_worker,
    started,
    usage,
    wait_for,
)

from sluice import prometheus
from sluice.prometheus import Histogram
from sluice.status import ErrorDetails

STREAM_BODY = {**CHAT_BODY, "stream": True}
SAMPLE = re.compile(r"^([a-z_:][a-z0-9_:]*)(\{.*\})? (\S+)$")


def parse_exposition(text: str) -> dict[str, float]:
    """{'name{labels}': value} for every sample; checks every line is well-formed."""
    assert text.endswith("\n")
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = SAMPLE.match(line)
        assert match, f"malformed exposition line: {line!r}"
        samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


# ------------------------------------------------------------- exposition helpers


def test_histogram_buckets_are_cumulative_and_le_inclusive() -> None:
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    assert histogram.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert (histogram.count, histogram.total) == (4, pytest.approx(3.65))
    lines = prometheus.histogram_family("x_seconds", "help", histogram, {"model": "m"})
    assert 'x_seconds_bucket{model="m",le="+Inf"} 4' in lines
    assert 'x_seconds_count{model="m"} 4' in lines
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram((1.0, 0.5))


def test_label_values_are_escaped() -> None:
    line = prometheus.sample("m", 1, {"address": 'a"b\\c\nd'})
    assert line == 'm{address="a\\"b\\\\c\\nd"} 1'
    assert parse_exposition(prometheus.render([line])) == {'m{address="a\\"b\\\\c\\nd"}': 1.0}


# ------------------------------------------------------------------ stream watcher


# -------------------------------------------------------------- the served endpoint


def test_metrics_endpoint_counts_requests_streams_and_worker_health() -> None:
    fake = FakeWorker(script=[started(), content("Hel"), content("lo"), finished(), usage()])

    async def body() -> None:
        dead = dead_address()
        async with (
            running_worker(fake) as address,
            running_edge([address, dead], api_keys=("sk-test",), health_interval_s=0.2) as base,
            httpx.AsyncClient() as client,
        ):
            auth = {"Authorization": "Bearer sk-test"}
            streamed = await client.post(f"{base}/v1/chat/completions", json=STREAM_BODY, headers=auth)
            assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
            bad = await client.post(f"{base}/v1/chat/completions", json={**CHAT_BODY, "n": 0}, headers=auth)
            assert bad.status_code == 400
            assert (await client.get(f"{base}/v1/models")).status_code == 401
            await client.get(f"{base}/no/such/route")

            response = await client.get(f"{base}/metrics")  # no key needed
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
            samples = parse_exposition(response.text)
            assert samples['sluice_edge_requests_total{route="/v1/chat/completions",status="200"}'] == 1
            assert samples['sluice_edge_requests_total{route="/v1/chat/completions",status="400"}'] == 1
            assert samples['sluice_edge_requests_total{route="/v1/models",status="401"}'] == 1
            assert samples['sluice_edge_requests_total{route="other",status="404"}'] == 1
            assert samples['sluice_edge_time_to_first_token_seconds_count{surface="openai"}'] == 1
            # "Hel", "lo" and the finish chunk: two gaps, fewer if some of them went out together.
            assert samples['sluice_edge_inter_chunk_gap_seconds_count{surface="openai"}'] <= 2
            assert samples['sluice_edge_time_to_first_token_seconds_bucket{le="+Inf",surface="openai"}'] == 1
            assert samples['sluice_edge_streams_in_flight{surface="openai"}'] == 0
            assert samples['sluice_edge_client_disconnects_total{surface="openai"}'] == 0
            assert samples[f'sluice_edge_worker_up{{address="{address}"}}'] == 1
            assert samples[f'sluice_edge_worker_up{{address="{dead}"}}'] == 0
            assert samples[f'sluice_edge_worker_outstanding_requests{{address="{address}"}}'] == 0

    run(body())


def test_metrics_endpoint_sees_disconnects_and_stream_errors() -> None:
    hang = FakeWorker(script=[started(), content("x"), Hang()])
    fail = FakeWorker(
        script=[
            started(),
            content("x"),
            Abort(ErrorDetails(code=grpc.StatusCode.INTERNAL, message="boom at 10.1.2.3")),
        ]
    )

    async def scrape(client: httpx.AsyncClient, base: str) -> dict[str, float]:
        return parse_exposition((await client.get(f"{base}/metrics")).text)

    async def body() -> None:
        async with (
            running_worker(hang) as hanging,
            running_worker(fail) as failing,
            httpx.AsyncClient(timeout=10) as client,
        ):
            async with running_edge([hanging]) as base:
                async with client.stream("POST", f"{base}/v1/chat/completions", json=STREAM_BODY) as response:
                    # Keep the line iterator referenced: a dropped one is finalized by asyncio, and
                    # httpx then closes the connection, which the edge rightly sees as a disconnect.
                    lines = response.aiter_lines()
                    async for line in lines:
                        if '"content":"x"' in line:
                            break
                    assert (await scrape(client, base))[
                        'sluice_edge_streams_in_flight{surface="openai"}'
                    ] == 1
                await wait_for(hang.cancelled.wait)

                async def settled() -> bool:
                    samples = await scrape(client, base)
                    return bool(
                        samples['sluice_edge_client_disconnects_total{surface="openai"}'] == 1
                        and samples['sluice_edge_streams_in_flight{surface="openai"}'] == 0
                    )

                await wait_for(settled)
            async with running_edge([failing]) as base:
                text = (await client.post(f"{base}/v1/chat/completions", json=STREAM_BODY)).text
                assert "event: error" in text and "10.1.2.3" not in text
                samples = await scrape(client, base)
                # Label order is the client library's (alphabetical); it carries no meaning.
                assert (
                    samples[
                        'sluice_edge_stream_errors_total{code="internal_error",surface="openai",type="api_error"}'
                    ]
                    == 1
                )
                assert samples['sluice_edge_client_disconnects_total{surface="openai"}'] == 0

    run(body())
