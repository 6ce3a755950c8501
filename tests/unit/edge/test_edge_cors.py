"""CORS (``--allowed-origins``): the setting, and the headers over HTTP on a served edge with a fake
worker: preflights before the API-key check, the allowed origin echoed on answers, errors and
streams, nothing at all for an origin not in the list, ``*`` without credentials."""

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

from edge.cors import parse_origins
from edge.settings import Settings

APP = "http://app.example:3000"
OTHER = "https://evil.example"
KEY = {"Authorization": "Bearer sk-cors"}
CORS_HEADERS = (
    "access-control-allow-origin",
    "access-control-allow-credentials",
    "access-control-allow-methods",
    "access-control-allow-headers",
    "access-control-expose-headers",
)


def test_the_setting_takes_origins_or_a_star_and_refuses_anything_else() -> None:
    assert Settings.from_args(["--workers", "h:1"], env={}).allowed_origins == ()
    settings = Settings.from_args(
        ["--workers", "h:1", "--allowed-origins", f"{APP}/, chrome-extension://abcdef ,"], env={}
    )
    assert settings.allowed_origins == (APP, "chrome-extension://abcdef")
    from_env = Settings.from_args(["--workers", "h:1"], env={"SLUICE_EDGE_ALLOWED_ORIGINS": "*"})
    assert from_env.allowed_origins == ("*",)
    for bad in ("app.example", "http://app.example/path", "http://a b"):
        with pytest.raises(ValueError, match="not an origin"):
            parse_origins(bad)


def preflight(origin: str, method: str = "POST") -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type",
    }


def test_allowed_origin_gets_preflight_answers_errors_and_streams_marked() -> None:
    fake = FakeWorker(script=[started(), content("ok"), finished(), usage()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], allowed_origins=(APP,), api_keys=("sk-cors",)) as base,
            httpx.AsyncClient(timeout=10) as client,
        ):
            # The preflight carries no key and still passes; it is answered at once.
            answer = await client.options(f"{base}/v1/chat/completions", headers=preflight(APP))
            assert answer.status_code == 204, answer.text
            assert answer.headers["access-control-allow-origin"] == APP
            assert answer.headers["access-control-allow-credentials"] == "true"
            assert "POST" in answer.headers["access-control-allow-methods"]
            assert answer.headers["access-control-allow-headers"] == "authorization, content-type"
            assert "Origin" in answer.headers["vary"]
            # A streamed answer, a JSON answer and an error all carry the origin.
            stream = await client.post(
                f"{base}/v1/chat/completions",
                json={**CHAT_BODY, "stream": True},
                headers={"Origin": APP, **KEY},
            )
            assert stream.status_code == 200 and stream.headers["content-type"].startswith(
                "text/event-stream"
            )
            assert stream.headers["access-control-allow-origin"] == APP and "data: [DONE]" in stream.text
            models = await client.get(f"{base}/v1/models", headers={"Origin": APP, **KEY})
            assert models.headers["access-control-allow-origin"] == APP
            assert "X-Request-ID" in models.headers["access-control-expose-headers"]
            refused = await client.get(f"{base}/v1/models", headers={"Origin": APP})
            assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == APP
            missing = await client.get(f"{base}/v1/nope", headers={"Origin": APP, **KEY})
            assert missing.status_code == 404 and missing.headers["access-control-allow-origin"] == APP
            # Another origin, or none, gets no CORS header at all (its browser refuses the answer).
            other = await client.options(f"{base}/v1/chat/completions", headers=preflight(OTHER))
            assert other.status_code != 204
            for response in (
                other,
                await client.get(f"{base}/v1/models", headers={"Origin": OTHER, **KEY}),
                await client.get(f"{base}/v1/models", headers=KEY),
            ):
                assert not any(name in response.headers for name in CORS_HEADERS), response.headers
                assert "Origin" in response.headers.get("vary", "")

    run(body())


def test_star_allows_any_origin_without_credentials_and_no_setting_means_no_cors() -> None:
    fake = FakeWorker()

    async def body() -> None:
        async with running_worker(fake) as address, httpx.AsyncClient(timeout=10) as client:
            async with running_edge([address], allowed_origins=("*",)) as base:
                answer = await client.options(f"{base}/v1/models", headers=preflight(OTHER, "GET"))
                assert answer.status_code == 204 and answer.headers["access-control-allow-origin"] == "*"
                models = await client.get(f"{base}/v1/models", headers={"Origin": OTHER})
                assert models.headers["access-control-allow-origin"] == "*"
                for response in (answer, models):
                    assert "access-control-allow-credentials" not in response.headers
            async with running_edge([address]) as base:
                answer = await client.options(f"{base}/v1/models", headers=preflight(APP, "GET"))
                models = await client.get(f"{base}/v1/models", headers={"Origin": APP})
                for response in (answer, models):
                    assert not any(name in response.headers for name in CORS_HEADERS), response.headers

    run(body())
