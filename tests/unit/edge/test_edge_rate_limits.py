"""Per-key rate limits: the counters' windows, the headers, the token meter, the keys file, and the
answers of an edge in process (OpenAI's and Anthropic's shapes, tokens counted as they stream)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest
from edge_fakes import (
    CHAT_BODY,
    FakeWorker,
    Hang,
    content,
    dead_address,
    finished,
    run,
    running_edge,
    running_worker,
    started,
)

from edge.rate_limits import (
    REQUESTS,
    TOKENS,
    KeyLimits,
    LocalCounters,
    TokenMeter,
    openai_duration,
    rate_limit_headers,
)
from edge.settings import Settings
from sluice.v1 import worker_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_count_down_then_refuse_until_the_window_resets() -> None:
    clock = Clock()
    counters = LocalCounters(clock)
    limits = KeyLimits(requests_per_minute=3)

    async def body() -> None:
        remaining = []
        for _ in range(3):
            decision = await counters.admit("k", limits)
            assert decision.refused is None
            remaining.append(decision.quotas[REQUESTS].remaining)
            clock.now += 10
        assert remaining == [2, 1, 0]
        refused = await counters.admit("k", limits)
        assert refused.refused == REQUESTS and refused.retry_after_s == pytest.approx(30.0)
        assert (await counters.admit("other", limits)).refused is None  # each key its own
        clock.now += 30  # the window opened at the first request, 60 s ago
        assert (await counters.admit("k", limits)).quotas[REQUESTS].remaining == 2

    run(body())


def test_tokens_refuse_once_spent_and_a_read_counts_nothing() -> None:
    clock = Clock()
    counters = LocalCounters(clock)
    limits = KeyLimits(tokens_per_minute=100)

    async def body() -> None:
        fresh = await counters.admit("k", limits)
        assert fresh.quotas[TOKENS].remaining == 100 and fresh.quotas[TOKENS].reset_s == 0
        counters.charge("k", 60)
        clock.now += 5
        assert (await counters.admit("k", limits, count=False)).quotas[TOKENS].remaining == 40
        counters.charge("k", 60)  # the last admitted request may take the window past its limit
        refused = await counters.admit("k", limits)
        assert refused.refused == TOKENS and refused.quotas[TOKENS].remaining == 0
        assert refused.retry_after_s == pytest.approx(55.0)
        clock.now += 55
        assert (await counters.admit("k", limits)).refused is None

    run(body())


def test_headers_in_openai_and_anthropic_forms() -> None:
    assert [openai_duration(s) for s in (0, 0.25, 12.5, 60, 59.0004)] == [
        "0ms",
        "250ms",
        "12.5s",
        "1m0s",
        "59.001s",
    ]

    async def decision() -> object:
        counters = LocalCounters(Clock())
        return await counters.admit("k", KeyLimits(requests_per_minute=5, tokens_per_minute=200))

    made = run(decision())
    assert rate_limit_headers(made, anthropic=False) == {  # type: ignore[arg-type]
        "x-ratelimit-limit-requests": "5",
        "x-ratelimit-remaining-requests": "4",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "200",
        "x-ratelimit-remaining-tokens": "200",
        "x-ratelimit-reset-tokens": "0ms",
    }
    anthropic = rate_limit_headers(made, anthropic=True, now=0.0)  # type: ignore[arg-type]
    assert anthropic["anthropic-ratelimit-requests-remaining"] == "4"
    assert anthropic["anthropic-ratelimit-requests-reset"] == "1970-01-01T00:01:00Z"
    assert anthropic["anthropic-ratelimit-tokens-limit"] == "200"


def _event(**kwargs: object) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(**kwargs)  # type: ignore[arg-type]


def test_meter_counts_prompt_and_deltas_as_they_come_and_the_rest_at_finish() -> None:
    charged: list[int] = []
    meter = TokenMeter(charged.append)
    meter.observe(0, started(prompt_tokens=7))
    meter.observe(0, content("a", token_ids=(1, 2)))
    meter.observe(0, _event(reasoning=worker_pb2.ReasoningDelta(choice_index=1, token_ids=[3])))
    meter.observe(0, _event(tool_call=worker_pb2.ToolCallDelta(choice_index=0, token_ids=[4])))
    meter.observe(0, content("b"))  # no ids: counted at its finish
    meter.observe(0, finished(0, tokens=5))  # 3 counted, 2 more (a stop token, a delta without ids)
    meter.observe(0, finished(1, tokens=1))
    meter.observe(1, finished(0, tokens=4))  # another call's choice 0
    assert charged == [7, 2, 1, 1, 2, 4]


def test_keys_file_lines_carry_limits_and_errors_name_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(
        "# keys\nsk-plain\nsk-rpm requests_per_minute=5\n\n"
        "sk-both  tokens_per_minute=200 requests_per_minute=9\n"
    )
    settings = Settings.from_args(["--workers", "h:1", "--api-keys-file", str(keys)], env={})
    assert settings.api_keys == ("sk-plain", "sk-rpm", "sk-both")
    assert settings.key_limits == (
        ("sk-rpm", KeyLimits(requests_per_minute=5)),
        ("sk-both", KeyLimits(requests_per_minute=9, tokens_per_minute=200)),
    )
    assert "sk-" not in repr(settings)
    for bad in ("sk-secret rpm=5", "sk-secret tokens_per_minute=0", "sk-secret requests_per_minute"):
        keys.write_text(f"sk-ok\n{bad}\n")
        with pytest.raises(SystemExit):
            Settings.from_args(["--workers", "h:1", "--api-keys-file", str(keys)], env={})
        err = capsys.readouterr().err
        assert "line 2" in err and "secret" not in err
    with pytest.raises(SystemExit):
        Settings.from_args(["--workers", "h:1", "--rate-limit-redis-url", "http://x"], env={})


def _limited_settings(tmp_path: Path) -> dict[str, object]:
    return {
        "api_keys": ("sk-rpm", "sk-tpm", "sk-free"),
        "key_limits": (
            ("sk-rpm", KeyLimits(requests_per_minute=2)),
            ("sk-tpm", KeyLimits(tokens_per_minute=20)),
        ),
    }


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_edge_answers_429_in_each_surface_shape_with_headers_on_every_answer(tmp_path: Path) -> None:
    fake = FakeWorker(script=[started(prompt_tokens=5), content("x", token_ids=(1,)), finished(tokens=1)])
    messages = {"model": CHAT_BODY["model"], "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], **_limited_settings(tmp_path)) as base,
            httpx.AsyncClient(timeout=10) as client,
        ):
            first = await client.post(f"{base}/v1/chat/completions", json=CHAT_BODY, headers=_auth("sk-rpm"))
            assert first.status_code == 200 and first.headers["x-ratelimit-remaining-requests"] == "1"
            models = await client.get(f"{base}/v1/models", headers=_auth("sk-rpm"))
            assert models.headers["x-ratelimit-remaining-requests"] == "1"  # read, not counted
            second = await client.post(f"{base}/v1/messages", json=messages, headers=_auth("sk-rpm"))
            assert second.status_code == 200
            assert second.headers["anthropic-ratelimit-requests-remaining"] == "0"
            assert "x-ratelimit-remaining-requests" not in second.headers
            over = await client.post(f"{base}/v1/chat/completions", json=CHAT_BODY, headers=_auth("sk-rpm"))
            assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
            assert over.headers["x-ratelimit-remaining-requests"] == "0"
            assert over.json()["error"]["code"] == "rate_limit_exceeded"
            assert over.json()["error"]["type"] == "requests" and "sk-" not in over.text
            over = await client.post(f"{base}/v1/messages", json=messages, headers=_auth("sk-rpm"))
            assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error"
            assert over.json()["type"] == "error" and "retry-after" in over.headers
            assert over.headers["anthropic-ratelimit-requests-remaining"] == "0"
            free = await client.post(f"{base}/v1/chat/completions", json=CHAT_BODY, headers=_auth("sk-free"))
            assert free.status_code == 200 and "x-ratelimit-limit-requests" not in free.headers
            metrics = (await client.get(f"{base}/metrics")).text
            assert 'sluice_edge_rate_limited_requests_total{limit="requests"} 2.0' in metrics
            assert fake.calls_started == 3  # the refused requests never reached a worker

    run(body())


def test_tokens_count_as_they_stream_and_refuse_the_key_once_spent(tmp_path: Path) -> None:
    fake = FakeWorker(script=[started(prompt_tokens=12), content("x", token_ids=(1, 2, 3)), Hang()])
    stream = {**CHAT_BODY, "stream": True}

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], **_limited_settings(tmp_path)) as base,
            httpx.AsyncClient(timeout=10) as client,
            contextlib.AsyncExitStack() as stack,
        ):
            response = await stack.enter_async_context(
                client.stream("POST", f"{base}/v1/chat/completions", json=stream, headers=_auth("sk-tpm"))
            )
            assert response.headers["x-ratelimit-remaining-tokens"] == "20"
            async for line in response.aiter_lines():
                if '"content":"x"' in line:
                    break
            # Mid-stream: 12 prompt + 3 generated tokens counted.
            left = await client.get(f"{base}/v1/models", headers=_auth("sk-tpm"))
            assert left.headers["x-ratelimit-remaining-tokens"] == "5"
            assert fake.requests[0].return_token_ids  # asked for, to count tokens as they stream
            fake.script = [started(prompt_tokens=12), content("y", token_ids=(4,)), finished(tokens=9)]
            done = await client.post(f"{base}/v1/chat/completions", json=CHAT_BODY, headers=_auth("sk-tpm"))
            assert done.status_code == 200
            over = await client.post(f"{base}/v1/chat/completions", json=CHAT_BODY, headers=_auth("sk-tpm"))
            assert over.status_code == 429 and over.json()["error"]["type"] == "tokens"
            assert over.headers["x-ratelimit-remaining-tokens"] == "0"

    run(body())


def test_an_unreachable_shared_counter_admits_requests_unlimited(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Serving goes on through a Redis outage: no headers, no refusal, one warning."""
    fake = FakeWorker(script=[started(), content("x"), finished()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge(
                [address], rate_limit_redis_url=f"redis://{dead_address()}", **_limited_settings(tmp_path)
            ) as base,
            httpx.AsyncClient(timeout=10) as client,
        ):
            for _ in range(3):  # over sk-rpm's 2 per minute
                answer = await client.post(
                    f"{base}/v1/chat/completions", json=CHAT_BODY, headers=_auth("sk-rpm")
                )
                assert answer.status_code == 200 and "x-ratelimit-limit-requests" not in answer.headers

    with caplog.at_level("WARNING", logger="sluice.edge"):
        run(body())
    warnings = [r for r in caplog.records if "rate-limit counters unavailable" in r.getMessage()]
    assert len(warnings) == 1


def test_a_concurrency_refusal_carries_the_headers_and_spends_no_quota(tmp_path: Path) -> None:
    fake = FakeWorker(script=[started(), content("x"), Hang()])
    stream = {**CHAT_BODY, "stream": True}

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], max_concurrent_per_key=1, **_limited_settings(tmp_path)) as base,
            httpx.AsyncClient(timeout=10) as client,
            client.stream(
                "POST", f"{base}/v1/chat/completions", json=stream, headers=_auth("sk-rpm")
            ) as held,
        ):
            assert held.headers["x-ratelimit-remaining-requests"] == "1"
            refused = await client.post(
                f"{base}/v1/chat/completions", json=CHAT_BODY, headers=_auth("sk-rpm")
            )
            assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
            assert refused.headers["x-ratelimit-remaining-requests"] == "1"  # read, not spent

    run(body())
