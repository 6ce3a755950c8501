"""A worker restarted on the same address after an outage is taken back within the bound (issue 17).

A real worker (``--fake-tokens``) and a real edge with its default health settings. The worker is
SIGKILLed, stays down until the edge's channel waits out its longest reconnect backoff
(``CHANNEL_OPTIONS`` in sluice/client.py: 0.5 s growing by 1.6x up to 5 s, about 15.5 s of outage)
and is restarted on the same port; the pool's fresh channel per re-check (edge/workers/pool.py)
takes it back at the first re-check after it answers. The retired bench/bench_reconnect.py
measured 60 s and 180 s outages (figures in docs/operations.md; docs/benchmarks.md "Retired scripts").
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from sluice.client import CHANNEL_OPTIONS
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration


def outage_to_the_longest_backoff_s() -> float:
    """Seconds down after which the edge's channel waits its longest reconnect backoff: gRPC's
    waits grow from ``grpc.initial_reconnect_backoff_ms`` by 1.6x (each up to 20 % longer) to
    ``grpc.max_reconnect_backoff_ms``, and one whole wait at that cap is taken too."""
    options = dict(CHANNEL_OPTIONS)
    wait, cap = (
        options["grpc.initial_reconnect_backoff_ms"] / 1000,
        options["grpc.max_reconnect_backoff_ms"] / 1000,
    )
    total = 0.0
    while wait < cap:
        total, wait = total + wait * 1.2, wait * 1.6
    return total + cap * 1.2


# Long enough for the channel's backoff to reach its cap (the pool's re-check backoff reaches its
# own, the health interval, sooner): about 15.5 s with the channel options of sluice/client.py.
ABSENCE_S = outage_to_the_longest_backoff_s()
# Issue 17's bar: a restarted worker serves again within this long after its health check
# answers. The edge's own bound is its health interval (5 s) plus 20 % jitter and a connect.
BAR_S = 15.0


def served(client: httpx.Client) -> bool:
    try:
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1})
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def test_a_worker_back_after_a_long_outage_serves_within_the_bar(
    tiny_model_dir: Path, model_cache: Path, tmp_path: Path
) -> None:
    worker = WorkerProcess(
        cache_dir=model_cache,
        log_dir=tmp_path,
        model=str(tiny_model_dir),
        extra=["--fake-tokens", "--served-model-name", "tiny"],  # the answers do not matter
    )
    with worker, EdgeProcess([worker.address], log_dir=tmp_path) as edge:
        with httpx.Client(base_url=edge.base_url, timeout=30) as client:
            assert served(client)
            worker.kill()
            while served(client):  # until the edge noticed
                time.sleep(0.1)
            time.sleep(ABSENCE_S)
            assert not served(client)
            worker.start()  # returns once its own health check answers SERVING
            healthy = time.monotonic()
            while not served(client):
                waited = time.monotonic() - healthy
                assert waited < BAR_S, f"not routed {waited:.1f} s after the worker answered its health check"
                time.sleep(0.1)
            print(f"routed {time.monotonic() - healthy:.2f} s after the worker's health check answered")
        assert "taken back" in edge.log_tail(200)
