"""Per-key rate limits through real edges in front of one fake-token worker: requests per minute
counting down to a 429, tokens per minute spent, and one limit shared by two edge processes through
a real Redis (Debian's redis-server, started here on a free port; ``make redis-deps`` installs it)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from edge.rate_limit_redis import RedisCounters
from edge.rate_limits import REQUESTS, KeyLimits
from tests.processes import EdgeProcess, WorkerProcess, free_port, scrape_metrics

pytestmark = pytest.mark.integration

KEYS = """\
sk-rpm requests_per_minute=5
sk-tpm tokens_per_minute=200
sk-shared requests_per_minute=4
sk-shared-tpm tokens_per_minute=200
"""
BODY = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "Tell me about the town."}],
    "max_tokens": 40,
}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def fake_worker(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    with WorkerProcess(
        cache_dir=model_cache, log_dir=tmp_path_factory.mktemp("rl-worker-log"), extra=["--fake-tokens"]
    ) as worker:
        yield worker


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of this module's own, without persistence, on a free port."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (make redis-deps installs it with apt, as root)")
    port = free_port()
    folder = tmp_path_factory.mktemp("redis")
    args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    log = (folder / "redis.log").open("wb")
    proc = subprocess.Popen([*args, "--dir", str(folder)], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_pong(port, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _wait_for_pong(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("redis-server did not answer PING in 30 s")


@pytest.fixture(scope="module")
def local_edge(
    fake_worker: WorkerProcess, keys_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EdgeProcess]:
    extra = ["--api-keys-file", str(keys_file)]
    with EdgeProcess([fake_worker.address], log_dir=tmp_path_factory.mktemp("rl-edge"), extra=extra) as edge:
        yield edge


def test_sixth_request_of_a_five_per_minute_key_is_a_429_after_headers_counting_down(
    local_edge: EdgeProcess,
) -> None:
    with httpx.Client(base_url=local_edge.base_url, timeout=30, headers=_auth("sk-rpm")) as client:
        remaining = []
        for _ in range(5):
            answer = client.post("/v1/chat/completions", json=BODY)
            assert answer.status_code == 200
            assert answer.headers["x-ratelimit-limit-requests"] == "5"
            assert answer.headers["x-ratelimit-reset-requests"].endswith("s")
            remaining.append(answer.headers["x-ratelimit-remaining-requests"])
        assert remaining == ["4", "3", "2", "1", "0"]
        refused = client.post("/v1/chat/completions", json={**BODY, "stream": True})
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert scrape_metrics(local_edge.port)["sluice_edge_rate_limited_requests_total"] == 1


def test_a_200_tokens_per_minute_key_is_refused_once_its_window_is_spent(local_edge: EdgeProcess) -> None:
    spent = 0
    with httpx.Client(base_url=local_edge.base_url, timeout=30, headers=_auth("sk-tpm")) as client:
        while spent < 200:
            answer = client.post("/v1/chat/completions", json=BODY)
            assert answer.status_code == 200
            # Exact: every token of the earlier answers counted, none of this one's yet.
            assert answer.headers["x-ratelimit-remaining-tokens"] == str(200 - spent)
            spent += answer.json()["usage"]["total_tokens"]
        refused = client.post("/v1/chat/completions", json=BODY)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert int(refused.headers["retry-after"]) >= 1


def test_a_redis_shared_limit_holds_over_two_edge_processes(
    fake_worker: WorkerProcess, keys_file: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    extra = ["--api-keys-file", str(keys_file), "--rate-limit-redis-url", redis_url]
    logs = [tmp_path_factory.mktemp("rl-shared") for _ in range(2)]
    with (
        EdgeProcess([fake_worker.address], log_dir=logs[0], extra=extra) as one,
        EdgeProcess([fake_worker.address], log_dir=logs[1], extra=extra) as other,
        httpx.Client(timeout=30, headers=_auth("sk-shared")) as client,
    ):
        remaining = []
        for edge in (one, other, one, other):
            answer = client.post(f"{edge.base_url}/v1/chat/completions", json=BODY)
            assert answer.status_code == 200
            remaining.append(answer.headers["x-ratelimit-remaining-requests"])
        assert remaining == ["3", "2", "1", "0"]
        for edge in (one, other):
            refused = client.post(f"{edge.base_url}/v1/chat/completions", json=BODY)
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"
        # Tokens spent through one edge are seen by the other once its counter has them.
        spent = client.post(f"{one.base_url}/v1/chat/completions", json=BODY, headers=_auth("sk-shared-tpm"))
        total = spent.json()["usage"]["total_tokens"]
        _wait_for_header(client, other.base_url, "x-ratelimit-remaining-tokens", str(200 - total))


def _wait_for_header(client: httpx.Client, base: str, name: str, value: str) -> None:
    """Reads the key's headers (``/v1/models`` counts nothing) until ``name`` is ``value``: the
    tokens of a finished answer reach Redis just after it."""
    deadline = time.monotonic() + 10
    seen = None
    while time.monotonic() < deadline:
        seen = client.get(f"{base}/v1/models", headers=_auth("sk-shared-tpm")).headers.get(name)
        if seen == value:
            return
        time.sleep(0.02)
    raise AssertionError(f"{name} stayed {seen}, expected {value}")


def test_redis_counters_admit_exactly_the_limit_under_concurrent_checks(redis_url: str) -> None:
    """Two stores (two edge processes' worth) racing 20 checks at a limit of 7: exactly 7 pass."""

    async def body() -> list[str | None]:
        stores = [RedisCounters(redis_url), RedisCounters(redis_url)]
        limits = KeyLimits(requests_per_minute=7)
        try:
            decisions = await asyncio.gather(*(stores[i % 2].admit("race", limits) for i in range(20)))
        finally:
            for store in stores:
                await store.close()
        return [d.refused for d in decisions]

    refused = asyncio.run(body())
    assert refused.count(None) == 7 and refused.count(REQUESTS) == 13
