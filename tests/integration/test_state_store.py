"""The edge's state store (edge/store/) on embedded SQLite and on a real PostgreSQL server: the
same schema and migrations, per-owner reads, the running states of a background response and its
takeover, stream events, conversations, and retention by age and by size."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge.store.batches import BatchRecord, BatchStore
from edge.store.conversations import ConversationRecord, ConversationStore
from edge.store.database import SQLITE_FILE, Database, SqliteDatabase
from edge.store.events import EventStore
from edge.store.files import FileStore, StoredFile
from edge.store.opening import connect, open_store, purge
from edge.store.responses import ResponseStore, Retention, StoredResponse, now_ms
from edge.store.schema import MIGRATIONS

pytestmark = pytest.mark.integration
DAY_S = 24 * 3600.0


@pytest.fixture(params=["sqlite", "postgresql"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str | None]]:
    """Where a store lives: a fresh SQLite folder, or a fresh database on the session's server."""
    if request.param == "sqlite":
        yield {"state_dir": str(tmp_path), "state_url": None}
        return
    yield {"state_dir": None, "state_url": fresh_database(request.getfixturevalue("postgres_url"))}


def fresh_database(server: str) -> str:
    """The URL of a new, empty database on the session's PostgreSQL server."""
    import psycopg

    name = f"t{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    return server.rsplit("/", 1)[0] + f"/{name}"


def record(identifier: str, owner: str = "key-a", *, size: int = 0, **fields: Any) -> StoredResponse:
    values: dict[str, Any] = {
        "created_at": int(time.time()),
        "status": "completed",
        "background": False,
        "response": {"id": identifier, "text": "x" * size},
        "input_items": [{"type": "message", "role": "user", "content": "hi"}],
        "conversation": [{"role": "user", "content": "hi"}],
    }
    values.update(fields)
    return StoredResponse(id=identifier, owner=owner, **values)


def opened(place: dict[str, str | None], retention: Retention | None = None) -> ResponseStore:
    return asyncio.run(
        open_store(place["state_dir"], place["state_url"], retention or Retention(30 * DAY_S, 0))
    )


def run(store: ResponseStore, work: Any) -> Any:
    """Runs ``work(store)`` on a fresh event loop, then closes the store's connection."""

    async def go() -> Any:
        try:
            return await work(store)
        finally:
            await store.database.close()

    return asyncio.run(go())


def test_migrations_run_once_and_a_second_edge_finds_them_done(place: dict[str, str | None]) -> None:
    async def twice() -> list[int]:
        first: Database = connect(place["state_dir"], place["state_url"])
        second: Database = connect(place["state_dir"], place["state_url"])
        try:
            # Two edges starting together: one migrates, the other waits for its lock and finds it done.
            return list(await asyncio.gather(first.migrate(), second.migrate()))
        finally:
            await first.close()
            await second.close()

    assert asyncio.run(twice()) == [len(MIGRATIONS)] * 2


def test_a_response_is_read_and_deleted_only_by_its_owner(place: dict[str, str | None]) -> None:
    async def work(store: ResponseStore) -> None:
        await store.put(record("resp_1", "key-a"))
        assert await store.get("resp_1", "key-b") is None
        assert not await store.delete("resp_1", "key-b")
        got = await store.get("resp_1", "key-a")
        assert got is not None and got.response == {"id": "resp_1", "text": ""}
        assert got.conversation == [{"role": "user", "content": "hi"}] and not got.background
        assert await store.delete("resp_1", "key-a")
        assert await store.get("resp_1", "key-a") is None
        assert not await store.delete("resp_1", "key-a")

    run(opened(place), work)


def test_a_cancelled_background_response_keeps_its_end_when_the_run_finishes(
    place: dict[str, str | None],
) -> None:
    async def work(store: ResponseStore) -> None:
        await store.put(record("resp_bg", status="queued", background=True, lease_until=now_ms() + 60_000))
        assert await store.renew("resp_bg", now_ms() + 60_000)
        assert not await store.cancel("resp_bg", "key-b", {"status": "cancelled"})
        assert await store.cancel("resp_bg", "key-a", {"status": "cancelled"})
        late = record("resp_bg", status="completed", background=True, response={"status": "completed"})
        assert not await store.finish(late)  # the run ended after the cancel: the cancel stands
        assert not await store.renew("resp_bg", now_ms() + 60_000)
        got = await store.get("resp_bg", "key-a")
        assert got is not None and got.status == "cancelled" and got.response == {"status": "cancelled"}
        assert not await store.cancel("resp_bg", "key-a", {"status": "cancelled"})

    run(opened(place), work)


def test_a_background_responses_turn_is_appended_with_its_end_and_only_then(
    place: dict[str, str | None],
) -> None:
    """A background response naming a conversation: its turn goes in with the write of its end,
    in one transaction; a response no longer running (cancelled, or ended by another run) writes
    nothing and appends nothing."""

    async def work(store: ResponseStore) -> list[str]:
        conversations = ConversationStore(store.database, 3600.0)
        await conversations.create(ConversationRecord("conv_f", "key-a", 1, {}), [{"id": "msg_0"}])
        for name in ("resp_ends", "resp_cancelled"):
            await store.put(record(name, status="in_progress", background=True))
        assert await store.cancel("resp_cancelled", "key-a", {"status": "cancelled"})
        # The last: a second run of the same response ending after the first.
        ends = (("resp_ends", True), ("resp_cancelled", False), ("resp_ends", False))
        for number, (name, writes) in enumerate(ends):
            items = [{"id": f"t{number}_{n}"} for n in "ab"]
            turn = conversations.appending("conv_f", items, store.still_running(name))
            assert await store.finish(record(name, status="completed", background=True), turn) is writes
        return [item["id"] for item in await conversations.items("conv_f")]

    assert run(opened(place), work) == ["msg_0", "t0_a", "t0_b"]


def test_a_running_response_whose_lease_ran_out_is_taken_over_by_one_edge(
    place: dict[str, str | None],
) -> None:
    body = {"model": "m", "input": "hi", "background": True}
    running = {"status": "in_progress", "background": True, "request": body}
    first, second = opened(place), opened(place)  # two edges' connections

    async def work(store: ResponseStore) -> None:
        await store.put(record("resp_live", lease_until=now_ms() + 60_000, **running))
        await store.put(record("resp_dead", lease_until=now_ms() - 1, **running))
        await store.put(record("resp_ended", lease_until=now_ms() - 1, status="completed", background=True))
        await store.put(record("resp_fore", lease_until=now_ms() - 1, status="in_progress"))
        claims = await asyncio.gather(*(each.take_over(now_ms() + 60_000) for each in (store, second)))
        (taken,) = [claim for claims_of_one in claims for claim in claims_of_one]
        assert taken.id == "resp_dead" and taken.request == body and taken.reruns == 1
        assert taken.lease_until > now_ms()
        assert await store.take_over(now_ms() + 60_000) == []  # its new lease holds
        await second.database.close()

    run(first, work)


def test_stream_events_are_read_after_a_number_and_go_with_their_response(
    place: dict[str, str | None],
) -> None:
    async def work(store: ResponseStore) -> None:
        events = EventStore(store.database)
        await store.put(record("resp_s", status="in_progress", background=True))
        await store.put(record("resp_t", status="in_progress", background=True))
        assert await events.last("resp_s") == -1
        made = [{"type": "x", "sequence_number": n, "n": n} for n in range(5)]
        await events.append("resp_s", made[:2])
        await events.append("resp_s", made[2:])
        await events.append("resp_t", made[:1])
        assert await events.after("resp_s", -1) == made and await events.after("resp_s", 2) == made[3:]
        assert await events.last("resp_s") == 4
        assert await store.delete("resp_s", "key-a")
        assert await events.after("resp_s", -1) == []
        await store.database.execute("DELETE FROM responses WHERE id = 'resp_t'")  # as a purge does
        assert await events.purge() == 1 and await events.after("resp_t", -1) == []

    run(opened(place), work)


def test_a_conversations_items_keep_their_order_and_only_its_owner_reaches_it(
    place: dict[str, str | None],
) -> None:
    async def work(store: ResponseStore) -> None:
        conversations = ConversationStore(store.database, 3600.0)
        item = [{"id": f"msg_{n}", "type": "message", "big": 2**70} for n in range(4)]
        await conversations.create(ConversationRecord("conv_a", "key-a", 1, {"k": "v"}), item[:1])
        await conversations.append("conv_a", item[1:3])
        await conversations.append("conv_a", item[3:])
        assert await conversations.items("conv_a") == item
        assert await conversations.get("conv_a", "key-b") is None
        assert not await conversations.update("conv_a", "key-b", {})
        assert not await conversations.delete("conv_a", "key-b")
        assert await conversations.update("conv_a", "key-a", {"k": "w"})
        got = await conversations.get("conv_a", "key-a")
        assert got is not None and got.answer()["metadata"] == {"k": "w"}
        assert await conversations.delete_item("conv_a", "msg_1") and not await conversations.delete_item(
            "conv_a", "msg_1"
        )
        await conversations.append("conv_a", [{"id": "msg_4"}])  # after the last, not in the gap
        assert [i["id"] for i in await conversations.items("conv_a")] == ["msg_0", "msg_2", "msg_3", "msg_4"]
        assert await conversations.delete("conv_a", "key-a")
        assert (
            await conversations.items("conv_a") == [] and await conversations.get("conv_a", "key-a") is None
        )

    run(opened(place), work)


def test_turns_appended_to_a_conversation_at_once_keep_their_items_together(
    place: dict[str, str | None],
) -> None:
    """Two responses naming one conversation end at the same moment: each turn's items are numbered
    after the last in its append's transaction, so neither takes the other's positions (a
    unique-key error)."""

    async def work(store: ResponseStore) -> None:
        conversations = ConversationStore(store.database, 3600.0)
        await conversations.create(ConversationRecord("conv_b", "key-a", 1, {}), [{"id": "msg_0"}])
        turns = [[{"id": f"t{turn}_{n}"} for n in range(3)] for turn in range(4)]
        await asyncio.gather(*(conversations.append("conv_b", turn) for turn in turns))
        ids = [item["id"] for item in await conversations.items("conv_b")]
        assert ids[0] == "msg_0" and sorted(ids[1:]) == sorted(i["id"] for turn in turns for i in turn)
        for turn in turns:  # each turn's items in order, one after another
            first = ids.index(turn[0]["id"])
            assert ids[first : first + 3] == [item["id"] for item in turn]

    run(opened(place), work)


def test_two_edges_appending_to_one_conversation_at_once_land_every_turn_in_order(
    place: dict[str, str | None],
) -> None:
    """Two edges (two connections) append turns to one conversation at the same moments: every
    turn lands, its items together, none lost to a unique-key error."""

    async def work() -> None:
        edges = [await open_store(place["state_dir"], place["state_url"], Retention(DAY_S, 0)) for _ in "ab"]
        try:
            stores = [ConversationStore(edge.database, 3600.0) for edge in edges]
            await stores[0].create(ConversationRecord("conv_d", "key-a", 1, {}), [{"id": "msg_0"}])
            turns = [[{"id": f"t{turn}_{n}"} for n in range(2)] for turn in range(8)]
            for pair in range(0, len(turns), 2):
                await asyncio.gather(
                    stores[0].append("conv_d", turns[pair]), stores[1].append("conv_d", turns[pair + 1])
                )
            ids = [item["id"] for item in await stores[1].items("conv_d")]
            assert len(ids) == 17 and sorted(ids[1:]) == sorted(i["id"] for turn in turns for i in turn)
            for turn in turns:
                first = ids.index(turn[0]["id"])
                assert ids[first : first + 2] == [item["id"] for item in turn]
        finally:
            for edge in edges:
                await edge.database.close()

    asyncio.run(work())


def test_an_append_waits_for_another_edges_append_in_flight_on_postgresql(postgres_url: str) -> None:
    """Another edge's append holds its transaction open (the conversation's row changed, an item
    inserted after the last): this edge's append waits for it, then numbers its item after that
    one (numbered without waiting, it took the same position: a unique-key error, a lost turn)."""
    import psycopg

    url = fresh_database(postgres_url)

    async def work() -> list[str]:
        store = await open_store(None, url, Retention(DAY_S, 0))
        conversations = ConversationStore(store.database, 3600.0)
        other = await psycopg.AsyncConnection.connect(url)  # not autocommit: one open transaction
        try:
            await conversations.create(ConversationRecord("conv_e", "key-a", 1, {}), [{"id": "msg_0"}])
            await other.execute("UPDATE conversations SET expires_at = expires_at WHERE id = 'conv_e'")
            await other.execute(
                "INSERT INTO conversation_items (conversation_id, position, id, item) "
                """VALUES ('conv_e', 1, 'msg_other', '{"id":"msg_other"}')"""
            )
            appending = asyncio.create_task(conversations.append("conv_e", [{"id": "msg_mine"}]))
            await _until_a_session_waits_for_a_lock(url)
            await other.commit()
            await appending
            return [item["id"] for item in await conversations.items("conv_e")]
        finally:
            await other.close()
            await store.database.close()

    assert asyncio.run(work()) == ["msg_0", "msg_other", "msg_mine"]


async def _until_a_session_waits_for_a_lock(url: str, within_s: float = 30.0) -> None:
    """Returns once a session of ``url``'s database waits for a lock (the condition the test waits
    on, read from ``pg_stat_activity``); fails after ``within_s``."""
    import psycopg

    deadline = time.monotonic() + within_s
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as watcher:
        while True:
            cursor = await watcher.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            row = await cursor.fetchone()
            if row is not None and row[0] > 0:
                return
            assert time.monotonic() < deadline, "no session came to wait for the lock"
            await asyncio.sleep(0.02)


def test_expired_responses_are_neither_read_nor_kept(place: dict[str, str | None]) -> None:
    async def work(store: ResponseStore) -> None:
        now = int(time.time())
        await store.put(record("resp_old", created_at=now - 2 * 3600))
        await store.put(record("resp_new", created_at=now))
        assert await store.get("resp_old", "key-a") is None  # past its ttl: never read, even unpurged
        assert await store.purge() == 1
        assert await store.get("resp_new", "key-a") is not None

    run(opened(place, Retention(ttl_s=3600.0, max_bytes=0)), work)


def test_over_the_size_limit_the_oldest_responses_go_first(place: dict[str, str | None]) -> None:
    async def work(store: ResponseStore) -> list[str]:
        now = int(time.time())
        for age, name in ((30, "resp_a"), (20, "resp_b"), (10, "resp_c")):
            await store.put(record(name, created_at=now - age, size=1000))
        assert await purge(store) == 1
        return [name for name in ("resp_a", "resp_b", "resp_c") if await store.get(name, "key-a")]

    # Each row holds a little over 1000 bytes: two fit in 2500, three do not.
    assert run(opened(place, Retention(ttl_s=DAY_S, max_bytes=2500)), work) == ["resp_b", "resp_c"]


def test_conversations_and_stream_events_count_against_the_size_limit(place: dict[str, str | None]) -> None:
    """One bound for responses with their stream events and conversations with their items: over
    it, what expires soonest goes first, whole (a response with its events, a conversation with
    its items)."""

    async def work(store: ResponseStore) -> dict[str, bool]:
        now, conversations = int(time.time()), ConversationStore(store.database, DAY_S)
        old = ConversationRecord("conv_old", "key-a", now - 60, {})
        await conversations.create(old, [{"id": "msg_o", "text": "o" * 1000}])  # ~1000 bytes
        # Its last change a minute ago: it expires before every response made since.
        await store.database.execute("UPDATE conversations SET expires_at = expires_at - 60000")
        await store.put(record("resp_a", created_at=now - 30, size=300))  # ~400 bytes ...
        events = [{"sequence_number": n, "delta": "e" * 200} for n in range(5)]
        await EventStore(store.database).append("resp_a", events)  # ... and ~1200 of events
        await store.put(record("resp_c", created_at=now - 10, size=1000))  # ~1100 bytes
        new = ConversationRecord("conv_new", "key-a", now, {})
        await conversations.create(new, [{"id": "msg_n", "text": "n" * 200}])  # ~230 bytes
        assert await purge(store) == 2
        return {
            "resp_a": await store.get("resp_a", "key-a") is not None,
            "resp_a events": await EventStore(store.database).after("resp_a", -1) != [],
            "resp_c": await store.get("resp_c", "key-a") is not None,
            "conv_old": await conversations.get("conv_old", "key-a") is not None,
            "conv_old items": await conversations.items("conv_old") != [],
            "conv_new": await conversations.get("conv_new", "key-a") is not None,
        }

    # conv_new and resp_c fit in 2500 bytes; resp_a with its events does not, nor conv_old after it.
    kept = run(opened(place, Retention(ttl_s=DAY_S, max_bytes=2500)), work)
    assert kept == {
        "resp_a": False,
        "resp_a events": False,
        "resp_c": True,
        "conv_old": False,
        "conv_old items": False,
        "conv_new": True,
    }


def test_sqlite_keeps_its_file_in_the_state_dir(tmp_path: Path) -> None:
    store = opened({"state_dir": str(tmp_path / "state"), "state_url": None})
    assert isinstance(store.database, SqliteDatabase)
    assert store.database.path == tmp_path / "state" / SQLITE_FILE and store.database.path.exists()
    run(store, lambda s: asyncio.sleep(0))


def _batch_record(batch_id: str, owner: str = "key-a") -> BatchRecord:
    created = now_ms()
    return BatchRecord(
        batch_id, owner, created, created + 3_600_000, "in_progress", 0, {"status": "in_progress"}
    )


def test_each_batch_line_is_claimed_by_one_edge_and_its_result_written_once(
    place: dict[str, str | None],
) -> None:
    async def work() -> None:
        retention = Retention(DAY_S, 0)
        first = await open_store(place["state_dir"], place["state_url"], retention)
        second = await open_store(place["state_dir"], place["state_url"], retention)  # another edge
        try:
            stores = [BatchStore(s.database, DAY_S) for s in (first, second)]
            await stores[0].create(_batch_record("batch_1"))
            await stores[0].add_lines("batch_1", [(f"c{n}", "{}") for n in range(10)])
            far = now_ms() + 60_000
            claimed = await asyncio.gather(
                *(store.claim_lines("batch_1", f"claim-{i}", 10, far) for i, store in enumerate(stores))
            )
            lines = [line for got in claimed for line, _, _ in got]
            assert sorted(lines) == list(range(1, 11))  # every line once, none twice
            holder = 0 if claimed[0] and claimed[0][0][0] == 1 else 1
            assert await stores[0].finish_line("batch_1", 1, f"claim-{holder}", True, "result")
            assert not await stores[0].finish_line("batch_1", 1, f"claim-{holder}", True, "again")
            assert not await stores[0].finish_line("batch_1", 2, "claim-other", True, "not its claim")
            assert (await stores[0].counts("batch_1")) == {"ok": 1, "running": 9}
        finally:
            await first.database.close()
            await second.database.close()

    asyncio.run(work())


def test_a_batch_line_given_back_or_left_by_a_stopped_edge_is_claimed_again(
    place: dict[str, str | None],
) -> None:
    async def work(store: ResponseStore) -> None:
        batches = BatchStore(store.database, DAY_S)
        await batches.create(_batch_record("batch_2"))
        await batches.add_lines("batch_2", [("a", "{}"), ("b", "{}")])
        await batches.claim_lines("batch_2", "released", 1, now_ms() + 60_000)
        await batches.claim_lines("batch_2", "crashed", 1, now_ms() - 1)  # its lease already lapsed
        await batches.release_line("batch_2", 1, "released")
        again = await batches.claim_lines("batch_2", "next", 5, now_ms() + 60_000)
        assert [(line, custom_id) for line, custom_id, _ in again] == [(1, "a"), (2, "b")]
        assert not await batches.finish_line("batch_2", 2, "crashed", True, "late")  # taken over
        results = await batches.results("batch_2")
        assert [(r.custom_id, r.status) for r in results] == [("a", "running"), ("b", "running")]

    run(opened(place), work)


def test_a_batch_moves_only_from_the_status_it_is_known_to_have(place: dict[str, str | None]) -> None:
    async def work(store: ResponseStore) -> None:
        batches = BatchStore(store.database, DAY_S)
        await batches.create(_batch_record("batch_3"))
        assert await batches.transition("batch_3", ("in_progress",), {"status": "cancelling"})
        assert not await batches.transition("batch_3", ("in_progress",), {"status": "finalizing"})
        got = await batches.get("batch_3", "key-a")
        assert got is not None and got.status == "cancelling" and got.batch == {"status": "cancelling"}
        assert await batches.get("batch_3", "key-b") is None

    run(opened(place), work)


def test_files_are_read_listed_and_deleted_only_by_their_owner(place: dict[str, str | None]) -> None:
    async def work(store: ResponseStore) -> None:
        files = FileStore(store.database, DAY_S)
        made = StoredFile("file-1", "key-a", int(time.time()), files.expiry(), "batch", "in.jsonl", 3)
        await files.put(made, "{}\n")
        assert await files.get("file-1", "key-b") is None and await files.content("file-1", "key-b") is None
        assert await files.get("file-1", "key-a") == made and await files.content("file-1", "key-a") == "{}\n"
        assert [f.id for f in await files.owned("key-a", "batch")] == ["file-1"]
        assert await files.owned("key-a", "batch_output") == [] and await files.owned("key-b", None) == []
        assert not await files.delete("file-1", "key-b") and await files.delete("file-1", "key-a")
        assert await files.get("file-1", "key-a") is None

    run(opened(place), work)
