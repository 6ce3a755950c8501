"""What the edge sends the worker's scheduler: each surface's ``priority``, and the tenant of the
caller's API key (``--api-keys-file`` entries name it), which no body can claim."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from edge_fakes import FakeWorker, content, finished, run, running_edge, running_worker, started, usage

from edge.settings import Settings, read_api_key_entries

MODEL = "m"
BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": MODEL, "prompt": "Hi"},
    "/v1/responses": {"model": MODEL, "input": "Hi"},
    "/v1/messages": {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
    "/api/v1/chat": {"model": MODEL, "input": "Hi"},
}


def test_key_file_entries_may_name_a_tenant_and_errors_never_show_a_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# teams\nsk-a1 tenant=team-a\nsk-a2   tenant=team-a\nsk-solo\n")
    entries = read_api_key_entries(str(keys))
    assert [(e.key, e.tenant) for e in entries] == [
        ("sk-a1", "team-a"),
        ("sk-a2", "team-a"),
        ("sk-solo", None),
    ]
    settings = Settings.from_args(["--workers", "h:1", "--api-keys-file", str(keys)])
    assert settings.api_keys == ("sk-a1", "sk-a2", "sk-solo")
    for bad in ("sk-secret tenant", "sk-secret team=x", "sk-secret tenant=a tenant=b", "sk-secret half"):
        keys.write_text(f"sk-ok\n{bad}\n")
        with pytest.raises(ValueError, match="line 2") as caught:
            read_api_key_entries(str(keys))
        assert "secret" not in str(caught.value) and "half" not in str(caught.value)


@pytest.mark.parametrize("path", list(BODIES))
def test_every_surface_sends_the_priority_and_the_keys_tenant_whatever_the_body_claims(
    path: str, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-a tenant=team-a\nsk-b\n")
    fake = FakeWorker(script=[started(), content("ok"), finished(), usage()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], api_keys=("sk-a", "sk-b"), api_keys_file=str(keys)) as base,
            httpx.AsyncClient() as client,
        ):
            for key, extra in (("sk-a", {"priority": -3}), ("sk-b", {"priority": 7}), ("sk-a", {})):
                response = await client.post(
                    f"{base}{path}",
                    json={**BODIES[path], **extra},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert response.status_code == 200, response.text
            claimed = await client.post(
                f"{base}{path}",
                json={**BODIES[path], "tenant": "team-a"},
                headers={"Authorization": "Bearer sk-b"},
            )
            assert claimed.status_code in (200, 400)  # ignored, or refused as unknown: never honoured

    run(body())
    sent = [(r.priority, r.tenant) for r in fake.requests]
    assert sent[:3] == [(-3, "team-a"), (7, "key#1"), (0, "team-a")]
    assert all(tenant == "key#1" for _, tenant in sent[3:])


def test_without_api_keys_every_request_is_of_one_tenant() -> None:
    fake = FakeWorker(script=[started(), content("ok"), finished(), usage()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(f"{base}/v1/chat/completions", json=BODIES["/v1/chat/completions"])
            assert response.status_code == 200

    run(body())
    assert [(r.priority, r.tenant) for r in fake.requests] == [(0, "")]


def test_a_priority_outside_int32_is_refused_naming_it() -> None:
    fake = FakeWorker(script=[started(), content("ok"), finished(), usage()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(
                f"{base}/v1/chat/completions", json={**BODIES["/v1/chat/completions"], "priority": 2**31}
            )
            assert response.status_code == 400 and response.json()["error"]["param"] == "priority"

    run(body())
    assert not fake.requests
