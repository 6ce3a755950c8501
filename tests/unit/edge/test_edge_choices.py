"""``n`` above what the model's workers serve (their ListModels ``max_n``: the contract's bound and
their --max-running) is a 400 naming ``n`` and the limit, before any worker call."""

from __future__ import annotations

from typing import Any

import httpx
from edge_fakes import FakeWorker, content, finished, run, running_edge, running_worker, started, usage

MODEL = "SmolLM2-135M-Instruct"
SCRIPT = [started(), content("ok"), finished(), usage()]


def chat(n: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": n}


async def post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        return await client.post(path, json=body)


def test_n_above_what_the_workers_serve_is_refused_naming_n_and_the_limit() -> None:
    async def go() -> None:
        fake = FakeWorker(script=SCRIPT, max_n=4)
        async with running_worker(fake) as address, running_edge([address]) as base:
            for path, body in (
                ("/v1/chat/completions", chat(5)),
                ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 5, "best_of": 5}),
            ):
                reply = await post(base, path, body)
                assert reply.status_code == 400, reply.text
                error = reply.json()["error"]
                assert (error["param"], error["code"]) == ("n", "invalid_value")
                assert "'n'" in error["message"] and "at most 4" in error["message"], error["message"]
                assert "got 5" in error["message"]
            assert fake.calls_started == 0
            reply = await post(base, "/v1/chat/completions", chat(4))
            assert reply.status_code == 200, reply.text
            assert fake.requests[-1].sampling.n == 4

    run(go())


def test_the_largest_worker_decides_and_a_silent_worker_decides_itself() -> None:
    async def go() -> None:
        small, large = FakeWorker(script=SCRIPT, max_n=2), FakeWorker(script=SCRIPT, max_n=3, worker_id="b")
        async with running_worker(small) as a, running_worker(large) as b, running_edge([a, b]) as base:
            reply = await post(base, "/v1/chat/completions", chat(4))
            assert reply.status_code == 400 and "at most 3" in reply.json()["error"]["message"]
        silent = FakeWorker(script=SCRIPT)  # an older worker: its ListModels has no max_n
        async with running_worker(silent) as address, running_edge([address]) as base:
            reply = await post(base, "/v1/chat/completions", chat(16))
            assert reply.status_code == 200, reply.text
            assert silent.requests[-1].sampling.n == 16

    run(go())
