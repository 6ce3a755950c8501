"""edge/workers/routing.py: chained prefix blocks, the bounded affinity map, the load-balance rule, and
the prefix-affinity policy inside the worker pool (fake clients)."""

from __future__ import annotations

from typing import Any

import pytest

from edge.settings import Settings
from edge.workers.call import WorkerCall
from edge.workers.routing import (
    BALANCE_ABS_THRESHOLD,
    PrefixAffinity,
    RoutingPolicy,
    load_unbalanced,
    prefix_blocks,
)
from sluice.v1 import worker_pb2
from tests.unit.edge.edge_fakes import run
from tests.unit.edge.test_edge_worker_pool import Fakes, make_pool

SYSTEM = "You are a helpful assistant."


def chat(*turns: tuple[str, str], model: str = "m", **fields: Any) -> worker_pb2.GenerateRequest:
    messages = [worker_pb2.ChatMessage(role=role, content=text) for role, text in turns]
    return worker_pb2.GenerateRequest(model=model, chat=worker_pb2.ChatInput(messages=messages, **fields))


def conversation(topic: str, turns: int) -> worker_pb2.GenerateRequest:
    """System prompt, then ``turns`` user messages with the assistant's answers between them."""
    messages = [("system", SYSTEM)]
    for turn in range(turns):
        if turn:
            messages.append(("assistant", f"answer {turn} about {topic}"))
        messages.append(("user", f"question {turn} about {topic}, " + "with details " * 20))
    return chat(*messages)


def digests(request: worker_pb2.GenerateRequest) -> list[bytes]:
    return [block.digest for block in prefix_blocks(request)]


def test_a_later_turn_extends_the_chain_of_the_earlier_turns() -> None:
    one, two, three = (digests(conversation("cats", n)) for n in (1, 2, 3))
    assert len(one) == 2 and len(two) == 4 and len(three) == 6
    assert two[:2] == one and three[:4] == two
    blocks = prefix_blocks(conversation("cats", 3))
    assert [b.end for b in blocks] == sorted(b.end for b in blocks)  # cumulative sizes


def test_blocks_differ_when_anything_before_them_differs() -> None:
    cats, dogs = digests(conversation("cats", 2)), digests(conversation("dogs", 2))
    assert cats[0] == dogs[0]  # the same system prompt (and header)
    assert cats[1] != dogs[1]
    other_model = digests(chat(("system", SYSTEM), model="other"))
    assert other_model[0] != digests(chat(("system", SYSTEM)))[0]
    tools = [worker_pb2.Tool(name="get_weather")]
    assert digests(chat(("system", SYSTEM), tools=tools))[0] != digests(chat(("system", SYSTEM)))[0]
    # The role is part of a message: the same text as another role is another prefix.
    assert digests(chat(("user", "hi")))[0] != digests(chat(("system", "hi")))[0]


def test_raw_prompts_are_sliced_and_empty_requests_have_no_blocks() -> None:
    text = "x" * 600
    blocks = prefix_blocks(worker_pb2.GenerateRequest(prompt=worker_pb2.PromptInput(text=text)))
    longer = prefix_blocks(worker_pb2.GenerateRequest(prompt=worker_pb2.PromptInput(text=text + "y" * 300)))
    assert len(blocks) == 3 and [b.digest for b in longer[:2]] == [b.digest for b in blocks[:2]]
    ids = worker_pb2.PromptInput(token_ids=worker_pb2.TokenIds(ids=list(range(130))))
    assert len(prefix_blocks(worker_pb2.GenerateRequest(prompt=ids))) == 3
    assert prefix_blocks(worker_pb2.GenerateRequest()) == []
    assert prefix_blocks(chat()) == []


def test_load_is_unbalanced_only_past_both_thresholds() -> None:
    big = BALANCE_ABS_THRESHOLD + 1
    assert not load_unbalanced({"a": 0})
    assert not load_unbalanced({"a": BALANCE_ABS_THRESHOLD, "b": 0})  # not more than the absolute bound
    assert load_unbalanced({"a": big, "b": 0})
    assert not load_unbalanced({"a": 2 * big, "b": 1.5 * big})  # far apart, but not 1.5x
    assert load_unbalanced({"a": 4 * big, "b": 2 * big})


def test_the_longest_recorded_prefix_wins_among_available_workers() -> None:
    affinity = PrefixAffinity()
    idle = {"a": 0, "b": 0}
    assert affinity.choose(prefix_blocks(conversation("cats", 1)), idle) is None  # nothing known
    affinity.record(prefix_blocks(conversation("cats", 1)), "a")
    affinity.record(prefix_blocks(conversation("dogs", 1)), "b")
    assert affinity.choose(prefix_blocks(conversation("cats", 2)), idle) == "a"
    assert affinity.choose(prefix_blocks(conversation("dogs", 2)), idle) == "b"
    # A match that covers less than half the request (one turn of three) does not pull it.
    assert affinity.choose(prefix_blocks(conversation("dogs", 3)), idle) is None
    # The system prompt alone (b recorded it last) is too short a share of a new conversation.
    assert affinity.choose(prefix_blocks(conversation("birds", 1)), idle) is None
    # A worker that is not available is not chosen.
    assert affinity.choose(prefix_blocks(conversation("cats", 2)), {"b": 0}) is None
    # Unbalanced load: fewest outstanding decides, whatever the cache.
    assert affinity.choose(prefix_blocks(conversation("cats", 2)), {"a": 40, "b": 0}) is None


def test_the_map_is_bounded_least_recently_used_first() -> None:
    affinity = PrefixAffinity(capacity=3)
    for topic, worker in (("cats", "a"), ("dogs", "b")):
        affinity.record(prefix_blocks(conversation(topic, 1)), worker)
    assert len(affinity) == 3  # the shared system-prompt block counts once
    affinity.choose(prefix_blocks(conversation("cats", 2)), {"a": 0, "b": 0})  # cats used again
    affinity.record(prefix_blocks(conversation("fish", 1)), "b")  # evicts the oldest: dogs
    assert len(affinity) == 3
    assert affinity.choose(prefix_blocks(conversation("dogs", 2)), {"a": 0, "b": 0}) is None
    assert affinity.choose(prefix_blocks(conversation("cats", 2)), {"a": 0, "b": 0}) == "a"
    with pytest.raises(ValueError, match="capacity"):
        PrefixAffinity(capacity=0)


def test_the_pool_keeps_conversations_on_their_workers() -> None:
    fakes = Fakes()

    async def served(pool: Any, request: worker_pb2.GenerateRequest) -> str:
        stream = await WorkerCall.open(pool, request, "r", 5.0)
        async for _event in stream:
            pass
        return str(stream.worker_address)

    async def body() -> None:
        pool = make_pool(["a:1", "b:2"], fakes, health_interval_s=60.0, routing=RoutingPolicy.PREFIX_AFFINITY)
        try:
            await pool.health()
            topics = [f"topic {i}" for i in range(6)]
            first = {topic: await served(pool, conversation(topic, 1)) for topic in topics}
            assert set(first.values()) == {"a:1", "b:2"}  # new conversations spread by load
            for turns in (2, 3, 4):
                for topic in topics:
                    assert await served(pool, conversation(topic, turns)) == first[topic]
            # One conversation at a time, all its turns before the next: the new conversations
            # still alternate (requests placed by affinity do not turn the round-robin).
            owners = []
            for topic in (f"sequential {i}" for i in range(4)):
                owners.append(await served(pool, conversation(topic, 1)))
                for turns in (2, 3, 4):
                    assert await served(pool, conversation(topic, turns)) == owners[-1]
            assert owners in (["a:1", "b:2"] * 2, ["b:2", "a:1"] * 2)
        finally:
            await pool.close()

    run(body())


def test_prefix_affinity_is_the_default_and_the_setting_parses() -> None:
    assert Settings(workers=("a:1",)).routing == RoutingPolicy.PREFIX_AFFINITY
    chosen = Settings.from_args(["--workers", "a:1", "--routing", "least-outstanding"], env={})
    assert chosen.routing == RoutingPolicy.LEAST_OUTSTANDING
    from_env = Settings.from_args(["--workers", "a:1"], env={"SLUICE_EDGE_ROUTING": "least-outstanding"})
    assert from_env.routing == RoutingPolicy.LEAST_OUTSTANDING
    with pytest.raises(SystemExit):
        Settings.from_args(["--workers", "a:1", "--routing", "random"], env={})
