"""The edge gives each worker call its stream write interval (``stream_interval_ms``), so the
worker keeps back what the pump would merge anyway: a real edge in front of a fake worker."""

from __future__ import annotations

import httpx
import pytest
from edge_fakes import (
    CHAT_BODY,
    FakeWorker,
    content,
    finished,
    run,
    running_edge,
    running_worker,
    started,
    usage,
)

from sluice.limits import MAX_STREAM_INTERVAL_MS


@pytest.mark.parametrize(
    ("interval_s", "expected_ms"), [(0.02, 20), (0.0, 0), (0.05, 50), (30.0, MAX_STREAM_INTERVAL_MS)]
)
def test_each_call_carries_the_edges_write_interval(interval_s: float, expected_ms: int) -> None:
    fake = FakeWorker(script=[started(), content("Hi"), finished(), usage()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], stream_write_interval_s=interval_s) as base,
            httpx.AsyncClient(timeout=20) as client,
        ):
            for stream in (True, False):
                response = await client.post(
                    f"{base}/v1/chat/completions", json={**CHAT_BODY, "stream": stream}
                )
                assert response.status_code == 200, response.text

    run(body())
    assert [request.stream_interval_ms for request in fake.requests] == [expected_ms, expected_ms]
