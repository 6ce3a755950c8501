"""Stored Responses' parts: a continuation's prompt, what a record keeps, the input-item pages, the
owner id of an API key, the background registry; background runs in in-process edges in front of
a fake worker (a run given back by a stopping edge and re-run by the next, one whose lease ran out
re-run up to the limit, a cancel through another edge, a streamed run followed live and again,
a conversation's turns)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from edge_fakes import (
    FakeWorker,
    Hang,
    Sleep,
    Step,
    content,
    finished,
    run,
    running_edge,
    running_worker,
    started,
    usage,
    wait_for,
)

from edge.auth import ANONYMOUS, ApiKeyCheck, key_id
from edge.background import BackgroundTasks
from edge.errors import InvalidRequestError
from edge.store.opening import open_store
from edge.store.responses import Retention, StoredResponse, now_ms
from edge.surfaces.responses.request import build_responses_request, validate_responses_request
from edge.surfaces.responses.resume import MAX_RERUNS
from edge.surfaces.responses.stored import numbered, record_of, replayable
from edge.surfaces.shared.paging import item_page

HISTORY: list[dict[str, Any]] = [
    {"type": "message", "role": "user", "content": "Name a color."},
    {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Blue.", "annotations": [], "logprobs": []}],
    },
]


def parsed(history: list[Any] | None = None, **fields: Any) -> Any:
    body = {"model": "m", "input": "Another?", **fields}
    return build_responses_request(validate_responses_request(body), history or [])


def test_a_continuation_sends_this_turns_instructions_then_the_history_then_the_input() -> None:
    chat = parsed(HISTORY, instructions="Be brief.").chat
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "Name a color."),
        ("assistant", "Blue."),
        ("user", "Another?"),
    ]


def test_store_defaults_to_true_and_the_response_echoes_the_state_fields() -> None:
    assert parsed().echo()["store"] is True
    echo = parsed(store=False).echo()
    assert echo["store"] is False and echo["background"] is False and echo["previous_response_id"] is None
    echo = parsed(background=True, previous_response_id="resp_1").echo()
    assert echo["background"] is True and echo["previous_response_id"] == "resp_1"


def test_a_record_keeps_the_whole_conversation_and_this_turns_numbered_input() -> None:
    request = parsed(HISTORY)
    response = {
        "id": "resp_2",
        "created_at": 5,
        "status": "completed",
        "background": False,
        "output": [
            {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}
        ],
    }
    record = record_of(request, response, "owner", HISTORY)
    assert record.conversation[:2] == HISTORY
    assert record.conversation[2] == {"type": "message", "role": "user", "content": "Another?"}
    assert record.conversation[3]["content"] == [{"type": "output_text", "text": "No."}]  # replayable
    [item] = record.input_items
    assert item["content"] == [{"type": "input_text", "text": "Another?"}] and item["id"].startswith("msg_")
    # The stored conversation is a valid history for the next turn.
    assert parsed(record.conversation).chat.messages[-2].content == "No."


def test_replayable_and_numbered_leave_their_input_alone() -> None:
    output = [{"type": "message", "content": [{"type": "refusal", "refusal": "No."}]}]
    assert replayable(output)[0]["content"] == [{"type": "output_text", "text": "No."}]
    assert output[0]["content"] == [{"type": "refusal", "refusal": "No."}]
    items = [
        {"role": "assistant", "content": "Hi"},
        {"type": "function_call_output", "call_id": "c", "output": "x"},
    ]
    listed = numbered(items)
    assert listed[0]["content"] == [{"type": "output_text", "text": "Hi"}] and listed[0]["type"] == "message"
    assert listed[1]["id"].startswith("item_") and "id" not in items[1]


ITEMS = [{"id": f"i{n}"} for n in range(5)]


@pytest.mark.parametrize(
    ("limit", "order", "after", "ids", "more"),
    [
        (None, None, None, ["i4", "i3", "i2", "i1", "i0"], False),
        ("2", None, None, ["i4", "i3"], True),
        ("2", "asc", "i1", ["i2", "i3"], True),
        ("5", "asc", "i3", ["i4"], False),
    ],
)
def test_input_items_are_paged_as_openai_pages_them(
    limit: str | None, order: str | None, after: str | None, ids: list[str], more: bool
) -> None:
    page = item_page(ITEMS, limit, order, after)
    assert [item["id"] for item in page["data"]] == ids and page["has_more"] is more
    assert page["first_id"] == ids[0] and page["last_id"] == ids[-1]


@pytest.mark.parametrize(
    ("limit", "order", "after", "param"),
    [
        ("x", None, None, "limit"),
        ("0", None, None, "limit"),
        ("101", None, None, "limit"),
        (None, "up", None, "order"),
        (None, None, "nope", "after"),
    ],
)
def test_a_bad_page_parameter_is_a_400_naming_it(limit: Any, order: Any, after: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        item_page(ITEMS, limit, order, after)
    assert caught.value.param == param


def test_a_keys_id_is_stable_and_shows_nothing_of_the_key() -> None:
    assert key_id("secret-key") == key_id("secret-key") != key_id("secret-kez")
    assert len(key_id("secret-key")) == 16 and "secret" not in key_id("secret-key")
    # The id follows the key, not its place in the list.
    assert ApiKeyCheck(["a", "b"])._ids[1] == ApiKeyCheck(["b"])._ids[0] == key_id("b")


def test_background_tasks_are_cancelled_at_close_and_run_their_cleanup() -> None:
    cleaned: list[str] = []

    async def work(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(name)

    async def scenario() -> None:
        tasks = BackgroundTasks()
        tasks.spawn("a", work("a"))
        tasks.spawn("b", work("b"))
        await asyncio.sleep(0)
        assert tasks.cancel("a") and not tasks.cancel("missing")
        await tasks.close()
        assert len(tasks) == 0

    asyncio.run(scenario())
    assert sorted(cleaned) == ["a", "b"]


# ------------------------------------------------ background runs, in-process edges and fake workers

BACKGROUND = {"model": "SmolLM2-135M-Instruct", "input": "Hi", "background": True}


def hang_then_answer(fake: FakeWorker) -> Callable[[Any], list[Step]]:
    """The fake's first call hangs (its edge stops under it); later ones answer "Blue."."""

    def script(request: Any) -> list[Step]:
        if fake.calls_started == 1:
            return [started(), Hang()]
        return [started(), content("Blue."), finished(), usage()]

    return script


async def stored(state_dir: Path, response_id: str) -> StoredResponse | None:
    store = await open_store(str(state_dir), None, Retention(3600.0, 0))
    try:
        return await store.get(response_id, ANONYMOUS)
    finally:
        await store.database.close()


async def polled_to_its_end(base: str, response_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        got: dict[str, Any] = {}

        async def ended() -> bool:
            got.update((await client.get(f"{base}/v1/responses/{response_id}")).json())
            return got["status"] not in ("queued", "in_progress")

        await wait_for(ended, 10)
        return got


def test_a_background_response_given_back_at_a_stop_is_rerun_by_the_next_edge(tmp_path: Path) -> None:
    fake = FakeWorker()
    fake.script_for = hang_then_answer(fake)

    async def scenario() -> tuple[StoredResponse | None, dict[str, Any]]:
        async with running_worker(fake) as address:
            async with (
                running_edge([address], state_dir=str(tmp_path)) as base,
                httpx.AsyncClient() as client,
            ):
                job = (await client.post(f"{base}/v1/responses", json=BACKGROUND)).json()
                assert job["status"] == "queued" and job["background"] is True
                await wait_for(lambda: fake.calls_started == 1)
                got = (await client.get(f"{base}/v1/responses/{job['id']}")).json()
                assert got["status"] == "in_progress"
            # The edge stopped with the run in flight: its worker call was cancelled.
            await asyncio.wait_for(fake.cancelled.wait(), 10)
            given_back = await stored(tmp_path, job["id"])
            async with running_edge([address], state_dir=str(tmp_path)) as base:
                return given_back, await polled_to_its_end(base, job["id"])

    given_back, done = run(scenario())
    assert given_back is not None and given_back.status == "queued" and given_back.lease_until == 0
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Blue."
    assert done["id"] == given_back.id and done["created_at"] == given_back.created_at
    # Re-run from its start: the same prompt and sampling as the first run.
    first, second = fake.requests
    assert (first.chat, first.sampling) == (second.chat, second.sampling) and fake.calls_started == 2


def lapsed(reruns: int) -> StoredResponse:
    """A background response left ``in_progress`` by an edge that crashed: its lease ran out."""
    request = build_responses_request(validate_responses_request(BACKGROUND), [])
    queued = {
        **request.echo(),
        "id": "resp_crashed",
        "created_at": now_ms() // 1000,
        "status": "in_progress",
        "output": [],
    }
    record = record_of(request, queued, ANONYMOUS, [])
    record.request, record.lease_until, record.reruns = BACKGROUND, now_ms() - 1, reruns
    return record


async def put(state_dir: Path, record: StoredResponse) -> None:
    store = await open_store(str(state_dir), None, Retention(3600.0, 0))
    try:
        await store.put(record)
    finally:
        await store.database.close()


@pytest.mark.parametrize("reruns", [0, MAX_RERUNS])
def test_a_response_whose_lease_ran_out_is_rerun_until_the_limit(tmp_path: Path, reruns: int) -> None:
    fake = FakeWorker(script=[started(), content("Blue."), finished(), usage()])

    async def scenario() -> dict[str, Any]:
        await put(tmp_path, lapsed(reruns))
        async with running_worker(fake) as address, running_edge([address], state_dir=str(tmp_path)) as base:
            return await polled_to_its_end(base, "resp_crashed")

    done = run(scenario())
    if reruns < MAX_RERUNS:
        assert done["status"] == "completed" and fake.calls_started == 1
    else:  # stopped once more than it may be re-run: it fails without a call
        assert done["status"] == "failed" and fake.calls_started == 0
        assert f"stopped {MAX_RERUNS + 1} times" in done["error"]["message"]


def test_a_cancel_through_another_edge_stops_the_run_at_its_next_renewal(tmp_path: Path) -> None:
    fake = FakeWorker(script=[started(), Hang()])
    lease = {"state_dir": str(tmp_path), "state_lease_s": 0.6}  # renewed every 0.2 s

    async def scenario() -> dict[str, Any]:
        async with (
            running_worker(fake) as address,
            running_edge([address], **lease) as runner,
            running_edge([address], **lease) as other,
            httpx.AsyncClient() as client,
        ):
            job = (await client.post(f"{runner}/v1/responses", json=BACKGROUND)).json()
            await wait_for(lambda: fake.calls_started == 1)
            cancelled = (await client.post(f"{other}/v1/responses/{job['id']}/cancel")).json()
            assert cancelled["status"] == "cancelled"
            await asyncio.wait_for(fake.cancelled.wait(), 10)  # the runner's edge stopped its call
            return dict((await client.get(f"{runner}/v1/responses/{job['id']}")).json())

    assert run(scenario())["status"] == "cancelled"


# ------------------------------------------------ streamed background runs (events in the store)

STREAMED = {**BACKGROUND, "stream": True}
ANSWER: list[Step] = [started(), content("Bl"), Sleep(0.05), content("ue."), finished(), usage()]


def named_events(raw: bytes) -> list[dict[str, Any]]:
    """The data of each named SSE frame (heartbeat comments left out)."""
    frames = [frame for frame in raw.decode().split("\n\n") if frame and not frame.startswith(":")]
    return [json.loads(frame.split("\n")[1].removeprefix("data: ")) for frame in frames]


def test_a_streamed_background_response_is_followed_live_and_again_after_a_number(tmp_path: Path) -> None:
    fake = FakeWorker(script=ANSWER)

    async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int]]:
        async with (
            running_worker(fake) as address,
            running_edge([address], state_dir=str(tmp_path)) as base,
            httpx.AsyncClient() as client,
        ):
            live = named_events((await client.post(f"{base}/v1/responses", json=STREAMED)).content)
            url = f"{base}/v1/responses/{live[0]['response']['id']}"
            again = named_events(
                (await client.get(url, params={"stream": "true", "starting_after": 2})).content
            )
            statuses = [
                (await client.get(url, params=params)).status_code
                for params in ({"stream": "maybe"}, {"stream": "true", "starting_after": "x"})
            ]
            plain = (await client.post(f"{base}/v1/responses", json=BACKGROUND)).json()
            answer = await client.get(f"{base}/v1/responses/{plain['id']}", params={"stream": "true"})
            return live, again, [*statuses, answer.status_code]

    live, again, statuses = run(scenario())
    assert [event["sequence_number"] for event in live] == list(range(len(live)))
    kinds = [event["type"] for event in live]
    assert kinds[:3] == ["response.queued", "response.created", "response.in_progress"]
    assert (
        kinds[-1] == "response.completed"
        and live[-1]["response"]["output"][0]["content"][0]["text"] == "Blue."
    )
    assert again == live[3:]
    assert statuses == [400, 400, 400]  # a bad flag, a bad number, a response created without stream


def test_a_rerun_streams_on_after_the_stopped_runs_events(tmp_path: Path) -> None:
    fake = FakeWorker()
    fake.script_for = hang_then_answer(fake)

    async def scenario() -> list[dict[str, Any]]:
        async with running_worker(fake) as address:
            async with (
                running_edge([address], state_dir=str(tmp_path)) as base,
                httpx.AsyncClient() as client,
            ):
                async with client.stream("POST", f"{base}/v1/responses", json=STREAMED) as answer:
                    async for line in answer.aiter_lines():  # the first event: response.queued
                        if line.startswith("data: "):
                            job_id = json.loads(line.removeprefix("data: "))["response"]["id"]
                            break
                await wait_for(lambda: fake.calls_started == 1)
            async with (
                running_edge([address], state_dir=str(tmp_path)) as base,
                httpx.AsyncClient() as client,
            ):
                url = f"{base}/v1/responses/{job_id}"
                await polled_to_its_end(base, job_id)
                return named_events((await client.get(url, params={"stream": "true"})).content)

    events = run(scenario())
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    kinds = [event["type"] for event in events]
    # The stopped run's first events, then the re-run's from its own response.created.
    assert kinds[:4] == ["response.queued", "response.created", "response.in_progress", "response.created"]
    assert kinds[-1] == "response.completed"


# ------------------------------------------------ conversations, in-process edges and fake workers


def test_a_conversations_items_are_the_earlier_turns_and_each_turn_is_appended(tmp_path: Path) -> None:
    fake = FakeWorker(script=[started(), content("Blue."), finished(), usage()])
    turn = {"model": "SmolLM2-135M-Instruct", "input": "And now?", "store": False}

    async def scenario() -> list[dict[str, Any]]:
        async with (
            running_worker(fake) as address,
            running_edge([address], state_dir=str(tmp_path)) as base,
            httpx.AsyncClient() as client,
        ):
            first = [{"role": "user", "content": "Name a color."}]
            conv = (await client.post(f"{base}/v1/conversations", json={"items": first})).json()
            answer = (
                await client.post(f"{base}/v1/responses", json={**turn, "conversation": conv["id"]})
            ).json()
            assert answer["conversation"] == {"id": conv["id"]}
            page = await client.get(f"{base}/v1/conversations/{conv['id']}/items", params={"order": "asc"})
            return list(page.json()["data"])

    items = run(scenario())
    (request,) = fake.requests
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("user", "Name a color."),
        ("user", "And now?"),
    ]
    assert [(item["role"], item["content"][0]["text"]) for item in items] == [
        ("user", "Name a color."),
        ("user", "And now?"),
        ("assistant", "Blue."),
    ]
    assert all(item["id"] for item in items)


def test_a_background_response_appends_its_turn_when_it_ends_and_a_cancelled_one_nothing(
    tmp_path: Path,
) -> None:
    fake = FakeWorker()
    fake.script_for = lambda request: (  # the first call answers, the second hangs until cancelled
        [started(), content("Blue."), finished(), usage()] if fake.calls_started == 1 else [started(), Hang()]
    )

    async def scenario() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        async with (
            running_worker(fake) as address,
            running_edge([address], state_dir=str(tmp_path)) as base,
            httpx.AsyncClient() as client,
        ):
            first = [{"role": "user", "content": "Name a color."}]
            conv = (await client.post(f"{base}/v1/conversations", json={"items": first})).json()
            turn = {**BACKGROUND, "input": "And now?", "conversation": conv["id"]}
            job = (await client.post(f"{base}/v1/responses", json=turn)).json()
            assert job["status"] == "queued" and job["conversation"] == {"id": conv["id"]}
            done = await polled_to_its_end(base, job["id"])
            hanging = (await client.post(f"{base}/v1/responses", json={**turn, "input": "More?"})).json()
            await wait_for(lambda: fake.calls_started == 2)
            await client.post(f"{base}/v1/responses/{hanging['id']}/cancel")
            await asyncio.wait_for(fake.cancelled.wait(), 10)
            assert (await polled_to_its_end(base, hanging["id"]))["status"] == "cancelled"
            page = await client.get(f"{base}/v1/conversations/{conv['id']}/items", params={"order": "asc"})
            return done, list(page.json()["data"])

    done, items = run(scenario())
    assert done["status"] == "completed"
    # The completed turn's input and output after the conversation's item; the cancelled one's not.
    assert [(item["role"], item["content"][0]["text"]) for item in items] == [
        ("user", "Name a color."),
        ("user", "And now?"),
        ("assistant", "Blue."),
    ]
    # The hanging run's prompt held the completed turn: the earlier turns of the conversation.
    assert [m.content for m in fake.requests[1].chat.messages] == [
        "Name a color.",
        "And now?",
        "Blue.",
        "More?",
    ]


def test_a_body_holding_an_integer_past_64_bits_is_stored(tmp_path: Path) -> None:
    """A client may send any JSON number in a field the edge ignores: the record (its request as sent,
    re-run after a restart) is written with it, not refused by the encoder (a 500 before)."""
    record = lapsed(0)
    record.request = {**BACKGROUND, "client_field": 2**70 + 1}
    run(put(tmp_path, record))
    read = run(stored(tmp_path, record.id))
    assert read is not None and read.request["client_field"] == 2**70 + 1
