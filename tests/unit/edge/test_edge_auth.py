"""Optional API keys: settings, the constant-time check, and the 401 answer over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from edge_fakes import (
    CHAT_BODY,
    FakeWorker,
    Hang,
    content,
    finished,
    run,
    running_edge,
    running_worker,
    started,
    usage,
    wait_for,
)

from edge.auth import ApiKeyCheck
from edge.concurrency import ConcurrencyLimiter
from edge.errors import AuthenticationError
from edge.settings import Settings

KEYS = ("sk-alpha", "sk-beta")
STREAM_BODY = {**CHAT_BODY, "stream": True}


def test_keys_from_flag_env_and_file_are_merged(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \nsk-alpha\n")
    settings = Settings.from_args(
        ["--workers", "h:1", "--api-keys", "sk-alpha, sk-beta,", "--api-keys-file", str(key_file)], env={}
    )
    assert settings.api_keys == ("sk-alpha", "sk-beta", "sk-file-1", "sk-file-2")
    from_env = Settings.from_args(["--workers", "h:1"], env={"SLUICE_EDGE_API_KEYS": "sk-env"})
    assert from_env.api_keys == ("sk-env",)
    assert Settings.from_args(["--workers", "h:1"], env={}).api_keys == ()


def test_keys_never_appear_in_repr_or_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    settings = Settings(workers=("h:1",), api_keys=("sk-secret-value",))
    assert "sk-secret-value" not in repr(settings)
    with pytest.raises(SystemExit):
        Settings.from_args(["--workers", "h:1", "--api-keys", "sk-ok,has space-secret"], env={})
    err = capsys.readouterr().err
    assert "--api-keys" in err and "secret" not in err
    with pytest.raises(SystemExit):
        Settings.from_args(["--workers", "h:1", "--api-keys-file", str(tmp_path / "missing")], env={})
    assert "--api-keys-file" in capsys.readouterr().err


def test_check_accepts_any_configured_key_and_only_guards_v1() -> None:
    check = ApiKeyCheck(KEYS)
    assert check.enabled and not ApiKeyCheck(()).enabled
    assert check.matches("sk-beta") and not check.matches("sk-bet") and not check.matches("")
    check.check("/v1/models", "Bearer sk-alpha")
    check.check("/v1/models", "bearer  sk-beta ")
    check.check("/health", None)
    check.check("/ready", "Bearer wrong")
    for header in (None, "", "sk-alpha", "Basic sk-alpha", "Bearer", "Bearer sk-gamma"):
        with pytest.raises(AuthenticationError) as caught:
            check.check("/v1/chat/completions", header)
        body = caught.value.payload()["error"]
        assert (body["type"], body["code"], caught.value.http_status) == (
            "invalid_request_error",
            "invalid_api_key",
            401,
        )
        assert "sk-" not in body["message"]  # neither a configured key nor the given token is echoed
    ApiKeyCheck(()).check("/v1/models", None)  # no keys: open


def test_edge_with_keys_answers_401_before_anything_else(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeWorker(script=[started(), content("ok"), finished(), usage()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], api_keys=KEYS) as base,
            httpx.AsyncClient() as client,
        ):
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/nope"):
                response = await client.post(f"{base}{path}", json=CHAT_BODY, headers={"X-Request-ID": "r-1"})
                assert response.status_code == 401
                assert response.headers["content-type"] == "application/json"
                assert response.headers["www-authenticate"] == "Bearer"
                assert response.headers["x-request-id"] == "r-1"
                assert response.json()["error"]["code"] == "invalid_api_key"
            wrong = await client.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-nope"})
            assert wrong.status_code == 401 and "Incorrect API key" in wrong.json()["error"]["message"]
            for path in ("/health", "/ready", "/openapi.json"):
                assert (await client.get(f"{base}{path}")).status_code == 200
            good = await client.post(
                f"{base}/v1/chat/completions", json=CHAT_BODY, headers={"Authorization": "Bearer sk-beta"}
            )
            assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] == "ok"

            sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as caught:
                await sdk.models.list()
            assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
            await sdk.close()
        assert fake.calls_started == 1  # only the authenticated request reached the worker

    with caplog.at_level(logging.DEBUG):
        run(body())
    assert all(key not in caplog.text for key in KEYS)


def test_a_refusal_before_the_body_arrived_closes_the_connection_and_says_so() -> None:
    """The key check answers from the headers alone; hypercorn then closes a connection whose body it
    has not read. The 401 says ``Connection: close``, so a client does not send its next request down
    that connection (the flake this fixed: httpx's "Server disconnected without sending a response"
    on the request after a 401, when the body came in a later packet than the headers)."""
    fake = FakeWorker(script=[started(), content("ok"), finished(), usage()])

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address], api_keys=KEYS) as base:
            host, port = base.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer sk-nope\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            )  # the body is never sent
            await writer.drain()
            head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode().lower()
            assert head.startswith("http/1.1 401") and "connection: close" in head, head
            writer.close()

    run(body())


# ------------------------------------------------------------ per-key concurrency


def test_match_index_names_the_key_without_exposing_it() -> None:
    check = ApiKeyCheck(KEYS)
    assert [check.match_index(t) for t in ("sk-alpha", "sk-beta", "sk-bet", "sk-alpha ", "")] == [
        0,
        1,
        None,
        None,
        None,
    ]
    assert check.check("/v1/models", "Bearer sk-beta") == 1 and check.check("/health", None) is None


def test_limiter_counts_per_identity_and_releases_once() -> None:
    limiter = ConcurrencyLimiter(2)
    a1, a2 = limiter.try_acquire("key#0"), limiter.try_acquire("key#0")
    assert a1 is not None and a2 is not None
    assert limiter.try_acquire("key#0") is None and limiter.rejected == 1
    b1 = limiter.try_acquire("key#1")
    assert b1 is not None and limiter.in_use() == 3 and limiter.in_use("key#0") == 2
    a1.release()
    a1.release()  # idempotent: a second release must not free someone else's slot
    assert limiter.in_use("key#0") == 1
    assert limiter.try_acquire("key#0") is not None
    for slot in (a2, b1):
        slot.release()
    assert limiter.in_use() == 1
    assert not ConcurrencyLimiter(0).enabled
    with pytest.raises(ValueError):
        ConcurrencyLimiter(-1)


def test_settings_reject_a_negative_concurrency_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        Settings.from_args(
            ["--workers", "h:1", "--max-concurrent-per-key", "3"], env={}
        ).max_concurrent_per_key
        == 3
    )
    with pytest.raises(SystemExit):
        Settings.from_args(["--workers", "h:1"], env={"SLUICE_EDGE_MAX_CONCURRENT_PER_KEY": "-1"})
    assert "--max-concurrent-per-key" in capsys.readouterr().err


async def _slots_in_use(client: httpx.AsyncClient, base: str) -> int:
    text = (await client.get(f"{base}/metrics")).text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("sluice_edge_concurrency_slots_in_use ")]
    return int(float(line.split()[1]))


async def _open_stream(
    client: httpx.AsyncClient, base: str, headers: dict[str, str], stack: contextlib.AsyncExitStack
) -> AsyncIterator[str]:
    """Opens a chat stream and reads up to its first content chunk; the stack closes it.

    Returns the line iterator: the caller keeps it, because a dropped iterator
    is finalized by the loop, which closes the response (a disconnect).
    """
    response = await stack.enter_async_context(
        client.stream("POST", f"{base}/v1/chat/completions", json=STREAM_BODY, headers=headers)
    )
    assert response.status_code == 200
    lines = response.aiter_lines()
    async for line in lines:
        if '"content":"x"' in line:
            break
    return lines


def test_concurrency_limit_per_key_answers_429_and_frees_slots_when_streams_end() -> None:
    fake = FakeWorker(script=[started(), content("x"), Hang()])
    alpha, beta = {"Authorization": "Bearer sk-alpha"}, {"Authorization": "Bearer sk-beta"}

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], api_keys=KEYS, max_concurrent_per_key=2) as base,
            httpx.AsyncClient(timeout=10) as client,
        ):
            async with contextlib.AsyncExitStack() as stack:
                kept = [await _open_stream(client, base, alpha, stack) for _ in range(2)]
                over = await client.post(f"{base}/v1/chat/completions", json=STREAM_BODY, headers=alpha)
                assert over.status_code == 429
                assert over.headers["content-type"] == "application/json"
                assert over.headers["retry-after"] == "1"
                error = over.json()["error"]
                assert (error["type"], error["code"]) == ("rate_limit_error", "concurrency_limit_exceeded")
                assert "sk-" not in over.text
                # Another key has its own slots; other routes take none.
                kept.append(await _open_stream(client, base, beta, stack))
                assert (await client.get(f"{base}/v1/models", headers=alpha)).status_code == 200
                assert await _slots_in_use(client, base) == 3 and len(kept) == 3

            # Closing the streams (client disconnects) gives every slot back, to be taken again.
            async def all_free() -> bool:
                return await _slots_in_use(client, base) == 0

            await wait_for(all_free)
            assert fake.calls_started == 3  # the refused request never reached a worker
            async with contextlib.AsyncExitStack() as stack:
                kept = [await _open_stream(client, base, alpha, stack) for _ in range(2)]

    run(body())


def test_no_slot_leaks_after_many_disconnects_at_every_stage() -> None:
    """Clients that leave before the headers, after the role chunk, mid-stream, or during a
    non-streamed answer: each slot comes back, and the caller can use its full limit again."""
    fake = FakeWorker(script=[started(), content("x"), Hang()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], max_concurrent_per_key=2) as base,
            httpx.AsyncClient(timeout=10) as client,
        ):

            async def all_free() -> bool:
                return await _slots_in_use(client, base) == 0

            for _ in range(10):
                async with contextlib.AsyncExitStack() as stack:  # mid-stream, 2 at once
                    kept = [await _open_stream(client, base, {}, stack) for _ in range(2)]
                    assert await _slots_in_use(client, base) == 2 and len(kept) == 2
                await wait_for(all_free)
                async with client.stream("POST", f"{base}/v1/chat/completions", json=STREAM_BODY) as r:
                    assert r.status_code == 200  # headers only, body never read
                await wait_for(all_free)
                with pytest.raises(httpx.ReadTimeout):  # non-streamed, the client gives up
                    await client.post(f"{base}/v1/chat/completions", json=CHAT_BODY, timeout=0.2)
                await wait_for(all_free)
            async with contextlib.AsyncExitStack() as stack:
                kept = [await _open_stream(client, base, {}, stack) for _ in range(2)]
                over = await client.post(f"{base}/v1/chat/completions", json=STREAM_BODY)
                assert over.status_code == 429 and len(kept) == 2
            await wait_for(lambda: fake.calls_cancelled == fake.calls_started)

    run(body(), timeout=60)
