"""The Batch API's parts: the input file's line checks, request counts, and the runner in in-process
edges in front of a fake worker (lines sent through the app's own hooks as their owner, at the
batch priority, at most ``--batch-concurrency`` at once, given back when refused for load or when
the edge stops, and finished by the next edge)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from edge_fakes import (
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
from quart import Quart

from edge.auth import key_id
from edge.store.batches import BatchStore
from edge.store.opening import open_store
from edge.store.responses import Retention
from edge.surfaces.batches import lines as batch_lines
from edge.surfaces.batches import route as batch_route
from edge.surfaces.batches import runner as batch_runner
from edge.surfaces.batches.lines import parse_lines
from edge.surfaces.batches.objects import request_counts
from sluice.limits import INT32_MAX
from sluice.v1 import worker_pb2

CHAT = "/v1/chat/completions"
MODEL = "SmolLM2-135M-Instruct"
ANSWER = [started(), content("Hi"), finished(), usage()]


@pytest.fixture(autouse=True)
def quick_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner looks for work often: a batch's steps follow each other quickly."""
    monkeypatch.setattr(batch_runner, "POLL_S", 0.02)


def line(custom_id: str, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body, **fields}


def jsonl(*items: Any) -> str:
    return "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items)


def test_valid_lines_are_parsed_and_blank_lines_skipped() -> None:
    parsed, errors = parse_lines(jsonl(line("a"), "   ", line("b")), CHAT)
    assert errors == [] and [(p.custom_id, p.body["model"]) for p in parsed] == [("a", MODEL), ("b", MODEL)]


def test_lines_end_only_at_newlines_not_at_the_separators_json_strings_may_hold() -> None:
    prompt = "one\u2028two\u2029three\x85four"  # valid raw in a JSON string; str.splitlines() breaks there
    body = {"model": MODEL, "prompt": prompt}
    text = json.dumps(line("a", body=body), ensure_ascii=False) + "\r\n" + json.dumps(line("b")) + "\n"
    parsed, errors = parse_lines(text, CHAT)
    assert errors == [] and [p.custom_id for p in parsed] == ["a", "b"] and parsed[0].body["prompt"] == prompt


def test_each_bad_line_is_named_with_its_number_code_and_param() -> None:
    body = line("x")["body"]
    text = jsonl(
        line("a"),
        "{oops",
        [1, 2],
        {"method": "POST", "url": CHAT, "body": body},
        line("a"),
        line("g", method="GET"),
        line("u", url="/v1/embeddings"),
        line("b", body="text"),
        line("s", body={**body, "stream": True}),
        line("k", body={**body, "background": True}),
    )
    _, errors = parse_lines(text, CHAT)
    assert [(e["line"], e["code"], e["param"]) for e in errors] == [
        (2, "invalid_json_line", None),
        (3, "invalid_request", None),
        (4, "missing_required_parameter", "custom_id"),
        (5, "duplicate_custom_id", "custom_id"),
        (6, "invalid_method", "method"),
        (7, "invalid_url", "url"),
        (8, "invalid_request", "body"),
        (9, "invalid_request", "body.stream"),
        (10, "invalid_request", "body.background"),
    ]
    assert all(e["message"] for e in errors)


def test_an_empty_file_and_one_over_the_line_limit_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [e["code"] for e in parse_lines("\n \n", CHAT)[1]] == ["empty_file"]
    monkeypatch.setattr(batch_lines, "MAX_LINES", 2)
    _, errors = parse_lines(jsonl(line("a"), line("b"), line("c")), CHAT)
    assert [(e["code"], e["line"]) for e in errors] == [("too_many_requests", None)]


def test_request_counts_count_expired_lines_as_failed_and_skipped_ones_in_the_total() -> None:
    counts = request_counts({"ok": 3, "failed": 1, "expired": 2, "skipped": 4})
    assert counts == {"total": 10, "completed": 3, "failed": 3}


@contextlib.asynccontextmanager
async def serving(fake: FakeWorker, **settings: Any) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    """An in-process edge (``settings``) in front of ``fake``: its base URL and a client."""
    async with (
        running_worker(fake) as address,
        running_edge([address], **settings) as base,
        httpx.AsyncClient() as client,
    ):
        yield base, client


async def _submit(
    client: httpx.AsyncClient, base: str, items: list[dict[str, Any]], key: str = "", endpoint: str = CHAT
) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    upload = await client.post(
        f"{base}/v1/files",
        files={"file": ("in.jsonl", jsonl(*items).encode())},
        data={"purpose": "batch"},
        headers=headers,
    )
    assert upload.status_code == 200, upload.text
    body = {"input_file_id": upload.json()["id"], "endpoint": endpoint, "completion_window": "24h"}
    created = await client.post(f"{base}/v1/batches", json=body, headers=headers)
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


async def _batch(client: httpx.AsyncClient, base: str, batch_id: str, key: str = "") -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer: dict[str, Any] = (await client.get(f"{base}/v1/batches/{batch_id}", headers=headers)).json()
    return answer


def test_lines_run_as_their_owner_at_the_batch_priority(tmp_path: Path) -> None:
    fake = FakeWorker(script=ANSWER)
    keys = ("key-a", "key-b")

    async def scenario() -> dict[str, Any]:
        async with serving(fake, state_dir=str(tmp_path), api_keys=keys) as (base, client):
            items = [line("plain"), line("own", body={**line("x")["body"], "priority": -5})]
            batch_id = await _submit(client, base, items, key=keys[1])
            await wait_for(lambda: _ended(client, base, batch_id, keys[1]), 20)
            return await _batch(client, base, batch_id, keys[1])

    done = run(scenario(), 30)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 2
    # Sent at the lowest priority (a line's own higher one raised to it), as the owner's tenant.
    assert [request.priority for request in fake.requests] == [INT32_MAX, INT32_MAX]
    assert {request.tenant for request in fake.requests} == {"key#1"}
    assert key_id(keys[1]) != key_id(keys[0])


class HeldWorker(FakeWorker):
    """A fake worker that holds each call until ``together`` calls are open."""

    def __init__(self, together: int, **fields: Any) -> None:
        super().__init__(**fields)
        self.together = together
        self.opened = 0
        self.all_open = asyncio.Event()

    async def Generate(  # gRPC method name
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        self.opened += 1
        if self.opened >= self.together:
            self.all_open.set()
        await self.all_open.wait()
        async for reply in super().Generate(request, context):
            yield reply


def test_lines_running_at_once_are_requests_of_their_own(tmp_path: Path) -> None:
    """Four lines of two owners' batches at once: each its own request id (to the worker and in
    its output line) and its own owner's tenant. (The runner once ran its lines inside the app
    context it was started from, where they shared one Quart ``g``: ids and keys leaked.)"""
    fake = HeldWorker(4, script=ANSWER)
    keys = ("key-a", "key-b")

    async def scenario() -> list[dict[str, Any]]:
        async with serving(fake, state_dir=str(tmp_path), api_keys=keys) as (base, client):
            ids = []
            for owner, key in zip("ab", keys, strict=True):
                items = [line(f"{owner}{n}", body={**line("x")["body"], "user": owner}) for n in (1, 2)]
                ids.append(await _submit(client, base, items, key=key))
            outputs = []
            for batch_id, key in zip(ids, keys, strict=True):
                await wait_for(lambda: _ended(client, base, batch_id, key), 20)  # noqa: B023
                done = await _batch(client, base, batch_id, key)
                url = f"{base}/v1/files/{done['output_file_id']}/content"
                text = (await client.get(url, headers={"Authorization": f"Bearer {key}"})).text
                outputs += [json.loads(row) for row in text.splitlines()]
            return outputs

    outputs = run(scenario(), 40)
    assert sorted((r.user, r.tenant) for r in fake.requests) == [("a", "key#0")] * 2 + [("b", "key#1")] * 2
    sent_ids = {r.request_id for r in fake.requests}
    assert len(sent_ids) == 4
    assert {o["response"]["request_id"] for o in outputs} == sent_ids


async def _ended(client: httpx.AsyncClient, base: str, batch_id: str, key: str = "") -> bool:
    status = (await _batch(client, base, batch_id, key))["status"]
    return status in ("completed", "failed", "cancelled", "expired")


@pytest.mark.parametrize(
    ("endpoint", "body", "kind"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}, "text_completion"),
        ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2}, "response"),
    ],
)
def test_completions_and_responses_lines_are_answered_in_their_own_shapes(
    tmp_path: Path, endpoint: str, body: dict[str, Any], kind: str
) -> None:
    fake = FakeWorker(script=ANSWER)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        async with serving(fake, state_dir=str(tmp_path)) as (base, client):
            item = {"custom_id": "a", "method": "POST", "url": endpoint, "body": body}
            batch_id = await _submit(client, base, [item], endpoint=endpoint)
            await wait_for(lambda: _ended(client, base, batch_id), 20)
            done = await _batch(client, base, batch_id)
            output = await client.get(f"{base}/v1/files/{done['output_file_id']}/content")
            return done, json.loads(output.text)

    done, answered = run(scenario(), 30)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 1
    assert answered["custom_id"] == "a" and answered["response"]["status_code"] == 200
    assert answered["response"]["body"]["object"] == kind
    assert [request.priority for request in fake.requests] == [INT32_MAX]  # at the batch priority


def test_at_most_batch_concurrency_lines_run_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rounds = [0]
    real_round = batch_runner.BatchRunner._round

    async def counted(self: batch_runner.BatchRunner) -> None:
        await real_round(self)
        rounds[0] += 1

    monkeypatch.setattr(batch_runner.BatchRunner, "_round", counted)
    fake = FakeWorker(script=[started(), Hang()])

    async def scenario() -> None:
        async with serving(fake, state_dir=str(tmp_path), batch_concurrency=2) as (base, client):
            await _submit(client, base, [line(f"l{n}") for n in range(5)])
            await wait_for(lambda: fake.calls_started == 2)
            seen = rounds[0]
            await wait_for(lambda: rounds[0] >= seen + 5)  # rounds went on with two lines running

    run(scenario(), 30)
    assert fake.calls_started == 2


def test_a_line_refused_for_load_is_given_back_and_runs_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusals = iter([429])  # a rate limit, or a worker queue that is full
    real_send = batch_runner.dispatch.send

    async def send(app: Any, url: str, body: dict[str, Any], owner: str) -> Any:
        status = next(refusals, None)
        if status is not None:  # the first send is refused for load, as a rate limit would
            return batch_runner.dispatch.Answer(status, "req_1", {"error": {"message": "slow down"}})
        return await real_send(app, url, body, owner)

    monkeypatch.setattr(batch_runner.dispatch, "send", send)
    fake = FakeWorker(script=ANSWER)

    async def scenario() -> dict[str, Any]:
        async with serving(fake, state_dir=str(tmp_path)) as (base, client):
            batch_id = await _submit(client, base, [line("only")])
            await wait_for(lambda: _ended(client, base, batch_id), 20)
            return await _batch(client, base, batch_id)

    done = run(scenario(), 30)
    assert done["status"] == "completed" and done["request_counts"] == {
        "total": 1,
        "completed": 1,
        "failed": 0,
    }
    assert done["error_file_id"] is None and fake.calls_started == 1


def test_lines_running_when_the_edge_stops_are_finished_by_the_next_edge(tmp_path: Path) -> None:
    hanging = FakeWorker(script=[started(), Hang()])
    answering = FakeWorker(script=ANSWER)

    async def scenario() -> dict[str, Any]:
        stopping = {"graceful_timeout_s": 0.0, "drain_delay_s": 0.0}
        async with serving(hanging, state_dir=str(tmp_path), **stopping) as (base, client):
            batch_id = await _submit(client, base, [line("a"), line("b")])
            await wait_for(lambda: hanging.calls_started == 2)
        async with serving(answering, state_dir=str(tmp_path)) as (base, client):
            # A bound for a loaded machine (a run under `make test-fast` took 20 s), kept under the
            # lines' 60 s lease: a line the stopped edge did not give back still fails the test.
            await wait_for(lambda: _ended(client, base, batch_id), 45)
            return await _batch(client, base, batch_id)

    done = run(scenario(), 75)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 2
    assert answering.calls_started == 2  # each line once more, and answered once


def test_lines_not_run_when_the_window_ends_expire_into_the_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_route, "WINDOW_S", 0)  # the window ends as the batch is created
    fake = FakeWorker(script=ANSWER)

    async def scenario() -> tuple[dict[str, Any], str]:
        async with serving(fake, state_dir=str(tmp_path)) as (base, client):
            batch_id = await _submit(client, base, [line("a"), line("b")])
            await wait_for(lambda: _ended(client, base, batch_id), 20)
            done = await _batch(client, base, batch_id)
            errors = (await client.get(f"{base}/v1/files/{done['error_file_id']}/content")).text
            return done, errors

    done, errors = run(scenario(), 30)
    assert done["status"] == "expired" and done["expired_at"] and done["output_file_id"] is None
    assert done["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    ended_lines = [json.loads(text) for text in errors.splitlines()]
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in ended_lines] == [
        ("a", None, "batch_expired"),
        ("b", None, "batch_expired"),
    ]
    assert fake.calls_started == 0


def test_a_line_whose_send_is_cancelled_at_shutdown_is_given_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_send = batch_runner.dispatch.send
    sending = asyncio.Event()

    async def stuck(app: Any, url: str, body: dict[str, Any], owner: str) -> Any:
        sending.set()
        await asyncio.Event().wait()  # no answer: only the runner's cancellation at shutdown ends it

    fake = FakeWorker(script=ANSWER)

    async def scenario() -> dict[str, Any]:
        monkeypatch.setattr(batch_runner.dispatch, "send", stuck)
        async with serving(fake, state_dir=str(tmp_path)) as (base, client):
            batch_id = await _submit(client, base, [line("a")])
            await asyncio.wait_for(sending.wait(), 10)
        monkeypatch.setattr(batch_runner.dispatch, "send", real_send)
        async with serving(fake, state_dir=str(tmp_path)) as (base, client):
            await wait_for(lambda: _ended(client, base, batch_id), 20)
            return await _batch(client, base, batch_id)

    done = run(scenario(), 40)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 1


def test_the_lines_of_a_key_no_longer_accepted_fail_with_a_401(tmp_path: Path) -> None:
    hanging = FakeWorker(script=[started(), Hang()])
    answering = FakeWorker(script=ANSWER)

    async def scenario() -> list[Any]:
        stopping = {"graceful_timeout_s": 0.0, "drain_delay_s": 0.0, "batch_concurrency": 1}
        async with serving(hanging, state_dir=str(tmp_path), api_keys=("key-old",), **stopping) as (
            base,
            client,
        ):
            batch_id = await _submit(client, base, [line("a"), line("b")], key="key-old")
            await wait_for(lambda: hanging.calls_started == 1)
        # The next edge no longer accepts the key: the batch's lines are refused as a client would be.
        store = await open_store(str(tmp_path), None, Retention(3600.0, 0))
        try:
            batches = BatchStore(store.database, 3600.0)
            async with serving(answering, state_dir=str(tmp_path), api_keys=("key-new",)):
                await wait_for(lambda: _final_in(batches, batch_id), 20)
            return [json.loads(result.result) for result in await batches.results(batch_id)]
        finally:
            await store.database.close()

    results = run(scenario(), 40)
    assert [(r["custom_id"], r["response"]["status_code"]) for r in results] == [("a", 401), ("b", 401)]
    assert answering.calls_started == 0


async def _final_in(batches: BatchStore, batch_id: str) -> bool:
    record = await batches.get(batch_id, None)
    return record is not None and record.status == "completed"


def test_a_line_answered_while_the_edge_stops_is_written_not_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop's cancel lands between the worker's answer and the store's write: the result is
    written, and the next edge does not send the line a second time."""
    real_send, real_finish = batch_runner.dispatch.send, BatchStore.finish_line
    sends: list[str] = []
    writing = asyncio.Event()

    async def counted(app: Any, url: str, body: dict[str, Any], owner: str) -> Any:
        sends.append(url)
        return await real_send(app, url, body, owner)

    async def slow(self: BatchStore, *args: Any) -> Any:
        writing.set()
        await asyncio.sleep(0.5)  # the edge's stop cancels the line task meanwhile
        return await real_finish(self, *args)

    fake = FakeWorker(script=ANSWER)

    async def scenario() -> dict[str, Any]:
        monkeypatch.setattr(batch_runner.dispatch, "send", counted)
        monkeypatch.setattr(BatchStore, "finish_line", slow)
        async with serving(fake, state_dir=str(tmp_path)) as (base, client):
            batch_id = await _submit(client, base, [line("a")])
            await asyncio.wait_for(writing.wait(), 10)
        monkeypatch.setattr(BatchStore, "finish_line", real_finish)
        async with serving(fake, state_dir=str(tmp_path)) as (base, client):
            await wait_for(lambda: _ended(client, base, batch_id), 20)
            return await _batch(client, base, batch_id)

    done = run(scenario(), 40)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 1
    assert len(sends) == 1


def test_a_line_given_back_and_claimed_again_is_still_given_back_when_the_edge_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line refused for load is given back, and the next round may claim it again before the
    first try's task has ended: the runner still tracks the second try, and gives its line back
    when the edge stops. (The first try's end once dropped the second from the runner, which then
    held the line for its whole lease: the next edge could not run it for a minute.)"""
    real_claim, real_release = BatchStore.claim_lines, BatchStore.release_line

    async def scenario() -> dict[str, int]:
        released, claimed_again, second_try = asyncio.Event(), asyncio.Event(), asyncio.Event()
        tries = 0

        async def send(app: Any, url: str, body: dict[str, Any], owner: str) -> Any:
            nonlocal tries
            tries += 1
            if tries == 1:
                return batch_runner.dispatch.Answer(503, "req_busy", {"error": {"message": "busy"}})
            second_try.set()
            await asyncio.Event().wait()  # running when the edge stops

        async def claim_lines(store: BatchStore, *args: Any) -> list[tuple[int, str, str]]:
            claimed = await real_claim(store, *args)
            if claimed and released.is_set():
                claimed_again.set()
            return claimed

        async def release_line(store: BatchStore, *args: Any) -> None:
            await real_release(store, *args)
            released.set()
            await claimed_again.wait()  # the first try ends only after the line was claimed again

        monkeypatch.setattr(batch_runner.dispatch, "send", send)
        monkeypatch.setattr(BatchStore, "claim_lines", claim_lines)
        monkeypatch.setattr(BatchStore, "release_line", release_line)
        stopping = {"graceful_timeout_s": 0.0, "drain_delay_s": 0.0}
        async with serving(FakeWorker(script=ANSWER), state_dir=str(tmp_path), **stopping) as (base, client):
            batch_id = await _submit(client, base, [line("a")])
            await asyncio.wait_for(second_try.wait(), 10)
        store = await open_store(str(tmp_path), None, Retention(3600.0, 0))
        try:
            return await BatchStore(store.database, 3600.0).counts(batch_id)
        finally:
            await store.database.close()

    assert run(scenario(), 30) == {"pending": 1}


def test_a_cancelled_lines_request_ends_as_when_a_client_leaves() -> None:
    """A line's send cancelled (its edge stops) ends the request in the app: the handler is
    cancelled, and its worker call with it, as when a client leaves. (Cancelling the app's call
    alone left the handler running: Quart does not pass a cancellation on.)"""

    async def scenario() -> None:
        entered, handler_cancelled = asyncio.Event(), asyncio.Event()
        app = Quart(__name__)

        @app.post(CHAT)
        async def held() -> str:
            entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                handler_cancelled.set()
                raise
            return ""

        send = asyncio.create_task(batch_runner.dispatch.send(app, CHAT, {"model": MODEL}, "anonymous"))
        await asyncio.wait_for(entered.wait(), 5)
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        await asyncio.wait_for(handler_cancelled.wait(), 5)

    run(scenario(), 15)
