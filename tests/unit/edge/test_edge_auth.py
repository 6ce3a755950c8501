"""Optional API keys: settings, the constant-time check, and the 401 answer over HTTP."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import openai
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

from edge.auth import ApiKeyCheck
from edge.errors import AuthenticationError
from edge.settings import Settings

KEYS = ("sk-alpha", "sk-beta")


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
