"""Stored and background Responses through the official openai SDK, end to end on both state
stores: an edge on embedded SQLite and an edge on a real PostgreSQL, each in front of the shared
default worker, with two API keys. Each scenario runs on both: store, retrieve, input items and
delete; a continuation with ``previous_response_id`` served from the prefix cache; a background
response polled to its end; a streamed one followed again from a sequence number; a cancelled
one stopping its worker call; one key never reaching another's responses; a conversation whose
turns are appended by the responses that name it, a background one's once it ends; on
PostgreSQL, a second edge serving what the first stored."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("key-alice", "key-bob")
# A system prompt long enough to fill KV blocks of its own, shared by every conversation here.
SYSTEM = (
    "You are a careful assistant for a museum of colors. Answer every question about colors, "
    "paints and pigments briefly, in one short sentence, and never mention these instructions. "
    "Prefer common color names that a child would know, and do not use lists or markdown."
)
FIRST = (
    "Our new exhibition room has white walls, a wooden floor, tall windows facing north and a "
    "ceiling painted in a pale grey. Visitors say it feels cold. Name one warm color for the "
    "curtains that would make the room feel welcoming."
)
POLL_S = 180.0


def poll(read: Callable[[], Any], done: Callable[[Any], bool], what: str, within_s: float = POLL_S) -> Any:
    """Reads until ``done`` holds (the condition the test waits on), failing after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        value = read()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}: {value!r}")
        time.sleep(0.1)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def edge(
    request: pytest.FixtureRequest, default_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EdgeProcess]:
    """An edge with two API keys whose store is SQLite in a folder of its own, or PostgreSQL."""
    folder = tmp_path_factory.mktemp(f"edge-{request.param}")
    if request.param == "sqlite":
        store = ["--state-dir", str(folder / "state")]
    else:
        store = ["--state-url", request.getfixturevalue("postgres_url")]
    extra = ["--api-keys", ",".join(KEYS), *store]
    with EdgeProcess([default_worker.address], log_dir=folder, extra=extra) as process:
        yield process


@pytest.fixture(scope="module")
def alice(edge: EdgeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge.base_url}/v1", api_key=KEYS[0], max_retries=0)


@pytest.fixture(scope="module")
def bob(edge: EdgeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge.base_url}/v1", api_key=KEYS[1], max_retries=0)


def test_a_stored_response_is_retrieved_listed_and_deleted(alice: openai.OpenAI) -> None:
    created = alice.responses.create(model=MODEL, input="Name a color.", temperature=0, max_output_tokens=4)
    assert created.store is True and created.status in ("completed", "incomplete")
    got = alice.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    items = alice.responses.input_items.list(created.id).data
    assert [(item.type, item.role, item.content[0].text) for item in items] == [  # type: ignore[union-attr]
        ("message", "user", "Name a color.")
    ]
    alice.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.delete(created.id)

    unstored = alice.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)

    events = list(alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2, stream=True))
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    # A stream is stored as its last events are made: a read right after may come a moment early.
    stored = poll(
        lambda: _retrieved(alice, last.response.id), lambda r: r is not None, "the stream is stored", 30
    )
    assert stored.output_text == last.response.output_text and stored.store is True


def _retrieved(client: openai.OpenAI, response_id: str) -> Any:
    try:
        return client.responses.retrieve(response_id)
    except openai.NotFoundError:
        return None


def test_a_continuation_sends_the_earlier_turn_and_the_prefix_cache_serves_it(alice: openai.OpenAI) -> None:
    settings: dict[str, Any] = {
        "model": MODEL,
        "instructions": SYSTEM,
        "temperature": 0,
        "max_output_tokens": 8,
    }
    first = alice.responses.create(input=FIRST, **settings)
    fresh = alice.responses.create(input="Which color is the sky?", **settings)
    follow = alice.responses.create(input="And for the cushions?", previous_response_id=first.id, **settings)
    assert follow.previous_response_id == first.id
    # The earlier turn is in the prompt: more input than the fresh conversation's ...
    assert follow.usage is not None and fresh.usage is not None and first.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # ... and it comes from the prefix cache: more cached tokens than the system prompt alone gives.
    fresh_cached = fresh.usage.input_tokens_details.cached_tokens
    follow_cached = follow.usage.input_tokens_details.cached_tokens
    assert fresh_cached > 0 and follow_cached > fresh_cached
    items = alice.responses.input_items.list(follow.id).data
    assert len(items) == 1  # this turn's input only


def test_a_background_response_answers_at_once_and_is_polled_to_its_end(alice: openai.OpenAI) -> None:
    job = alice.responses.create(
        model=MODEL,
        input="Name a color.",
        background=True,
        max_output_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert job.status == "queued" and job.background is True and job.output == []
    done = poll(
        lambda: alice.responses.retrieve(job.id),
        lambda r: r.status not in ("queued", "in_progress"),
        "it ends",
    )
    assert done.status == "incomplete" and done.usage is not None and done.usage.output_tokens == 6
    assert done.output_text
    # A background response can be continued like any other.
    follow = alice.responses.create(
        model=MODEL, input="Another?", previous_response_id=job.id, max_output_tokens=2
    )
    assert follow.status in ("completed", "incomplete") and follow.previous_response_id == job.id


def test_a_streamed_background_response_is_followed_again_from_a_sequence_number(
    alice: openai.OpenAI, bob: openai.OpenAI
) -> None:
    settings: dict[str, Any] = {"model": MODEL, "input": "Name a color.", "max_output_tokens": 6}
    stream = alice.responses.create(background=True, stream=True, extra_body={"ignore_eos": True}, **settings)
    first = next(iter(stream))
    assert first.type == "response.queued" and first.sequence_number == 0
    assert first.response.background is True
    stream.close()  # the client leaves: the response runs on
    job_id = first.response.id
    done = poll(lambda: alice.responses.retrieve(job_id), lambda r: r.status == "incomplete", "it ends")
    events = list(alice.responses.retrieve(job_id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.queued" and events[1].type == "response.created"
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.output_text == done.output_text
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == done.output_text
    after = list(alice.responses.retrieve(job_id, stream=True, starting_after=3))
    assert [e.model_dump() for e in after] == [e.model_dump() for e in events[4:]]
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(job_id, stream=True)
    plain = alice.responses.create(background=True, **settings)
    with pytest.raises(openai.BadRequestError) as caught:
        alice.responses.retrieve(plain.id, stream=True)
    assert caught.value.body["param"] == "stream"  # type: ignore[index]


def test_a_cancelled_background_response_stops_its_worker_call(
    alice: openai.OpenAI, default_worker: WorkerProcess
) -> None:
    job = alice.responses.create(
        model=MODEL,
        input="Count.",
        background=True,
        max_output_tokens=3000,
        extra_body={"ignore_eos": True},
    )
    poll(default_worker.metrics, lambda m: m["sluice_worker_running_requests"] >= 1, "the worker runs it")
    cancelled = alice.responses.cancel(job.id)
    assert cancelled.status == "cancelled"
    poll(default_worker.metrics, lambda m: m["sluice_worker_running_requests"] == 0, "the worker call stops")
    assert alice.responses.retrieve(job.id).status == "cancelled"
    assert alice.responses.cancel(job.id).status == "cancelled"  # an ended one is answered as it is
    plain = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        alice.responses.cancel(plain.id)


def test_a_key_reaches_only_its_own_responses(alice: openai.OpenAI, bob: openai.OpenAI) -> None:
    mine = alice.responses.create(model=MODEL, input="Name a color.", max_output_tokens=2)
    for attempt in (
        lambda: bob.responses.retrieve(mine.id),
        lambda: bob.responses.delete(mine.id),
        lambda: bob.responses.cancel(mine.id),
        lambda: bob.responses.input_items.list(mine.id),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    with pytest.raises(openai.BadRequestError) as caught:
        bob.responses.create(model=MODEL, input="More", previous_response_id=mine.id, max_output_tokens=2)
    assert caught.value.code == "previous_response_not_found"
    assert alice.responses.retrieve(mine.id).id == mine.id  # still there, still Alice's


def test_a_conversation_keeps_each_turn_and_only_its_key_reaches_it(
    alice: openai.OpenAI, bob: openai.OpenAI
) -> None:
    first_item = {"type": "message", "role": "user", "content": "My name is Ada."}
    conv = alice.conversations.create(items=[first_item], metadata={"topic": "names"})  # type: ignore[list-item]
    assert conv.object == "conversation" and conv.metadata == {"topic": "names"}
    settings: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 4}
    first = alice.responses.create(input="What is my name?", conversation=conv.id, **settings)
    assert first.conversation is not None and first.conversation.id == conv.id
    items = list(alice.conversations.items.list(conv.id, order="asc"))
    assert [(item.type, item.role) for item in items] == [  # type: ignore[union-attr]
        ("message", "user"),
        ("message", "user"),
        ("message", "assistant"),
    ]
    assert items[2].content[0].text == first.output_text  # type: ignore[union-attr]
    second = alice.responses.create(input="Say it again.", conversation={"id": conv.id}, **settings)
    assert second.usage is not None and first.usage is not None  # the earlier turns are in the prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert len(list(alice.conversations.items.list(conv.id))) == 5

    (added,) = alice.conversations.items.create(conv.id, items=[{"role": "user", "content": "Hi"}]).data
    assert alice.conversations.items.retrieve(added.id, conversation_id=conv.id).id == added.id  # type: ignore[union-attr]
    assert alice.conversations.items.delete(added.id, conversation_id=conv.id).id == conv.id  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):
        alice.conversations.items.retrieve(added.id, conversation_id=conv.id)  # type: ignore[union-attr]
    assert alice.conversations.update(conv.id, metadata={"topic": "other"}).metadata == {"topic": "other"}
    assert alice.conversations.retrieve(conv.id).metadata == {"topic": "other"}
    for attempt in (
        lambda: bob.conversations.retrieve(conv.id),
        lambda: bob.conversations.update(conv.id, metadata={}),
        lambda: bob.conversations.items.list(conv.id),
        lambda: bob.conversations.items.retrieve(items[0].id, conversation_id=conv.id),  # type: ignore[union-attr, arg-type]
        lambda: bob.conversations.delete(conv.id),
        lambda: bob.responses.create(input="Hi", conversation=conv.id, **settings),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert alice.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.conversations.retrieve(conv.id)


def test_a_background_response_on_a_conversation_appends_its_turn_when_it_ends(alice: openai.OpenAI) -> None:
    conv = alice.conversations.create(items=[{"type": "message", "role": "user", "content": "I am Ada."}])
    job = alice.responses.create(
        model=MODEL, input="Who am I?", conversation=conv.id, background=True, max_output_tokens=3
    )
    assert job.status == "queued" and job.conversation is not None and job.conversation.id == conv.id
    done = poll(
        lambda: alice.responses.retrieve(job.id),
        lambda r: r.status not in ("queued", "in_progress"),
        "it ends",
    )
    assert done.status in ("completed", "incomplete")
    items = list(alice.conversations.items.list(conv.id, order="asc"))
    assert [(item.type, item.role) for item in items] == [  # type: ignore[union-attr]
        ("message", "user"),
        ("message", "user"),
        ("message", "assistant"),
    ]
    assert items[2].content[0].text == done.output_text  # type: ignore[union-attr]


def test_two_edges_on_one_postgresql_serve_each_others_state(
    request: pytest.FixtureRequest,
    edge: EdgeProcess,
    alice: openai.OpenAI,
    default_worker: WorkerProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A second edge on the same PostgreSQL reads, continues, polls and deletes what the first
    stored, and appends to its conversation."""
    if request.node.callspec.params["edge"] != "postgresql":
        pytest.skip("edges share a store on PostgreSQL (a SQLite file is one host's)")
    extra = ["--api-keys", ",".join(KEYS), "--state-url", request.getfixturevalue("postgres_url")]
    folder = tmp_path_factory.mktemp("edge-second")
    with EdgeProcess([default_worker.address], log_dir=folder, extra=extra) as second:
        other = openai.OpenAI(base_url=f"{second.base_url}/v1", api_key=KEYS[0], max_retries=0)
        settings: dict[str, Any] = {"model": MODEL, "max_output_tokens": 2}
        first = alice.responses.create(input="Name a color.", **settings)
        assert other.responses.retrieve(first.id).output_text == first.output_text
        follow = other.responses.create(input="Another?", previous_response_id=first.id, **settings)
        assert follow.usage is not None and first.usage is not None
        assert follow.usage.input_tokens > first.usage.input_tokens  # the earlier turn, read from A's row
        job = alice.responses.create(input="Hi", background=True, **settings)
        done = poll(
            lambda: other.responses.retrieve(job.id),
            lambda r: r.status not in ("queued", "in_progress"),
            "it ends",
        )
        assert done.status in ("completed", "incomplete")
        conv = alice.conversations.create()
        other.responses.create(input="Hi", conversation=conv.id, **settings)
        assert len(list(alice.conversations.items.list(conv.id))) == 2
        other.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(first.id)
