"""Speculation under tensor parallelism without processes: the settings serve ``--speculative``
with it, a hybrid model's kept proposals are told to the followers (their state slots advanced over
the same proposals), and a follower's loop runs what rank 0 tells it in order."""

from __future__ import annotations

from typing import Any

import torch

from worker.config import WorkerConfig
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work
from worker.parallel.group import Accepted, Execute, Layout, Message, RankGroup, Relay, Score, Stop
from worker.parallel.ranks import follow


class Told(RankGroup):
    """A control channel in one thread: what rank 0 sends, and what a follower then receives."""

    def __init__(self, messages: list[Message] | None = None):
        self.layout = Layout(0, 2, 0, "")
        self.messages = list(messages or [])
        self.sent: list[Message] = []

    def send(self, message: Message) -> None:  # type: ignore[override]
        self.sent.append(message)

    def receive(self) -> Message:
        return self.messages.pop(0)


def test_speculation_is_served_with_tensor_parallelism() -> None:
    for proposer in ("ngram", "draft"):
        config = WorkerConfig(tensor_parallel_size=2, speculative=proposer, draft_model="/d")
        assert not [p for p in config.problems() if "--speculative" in p], proposer


def test_a_hybrid_models_kept_proposals_are_told_to_the_followers_and_others_not() -> None:
    told = Told()
    runner = ModelRunner.__new__(ModelRunner)
    runner.followers = Relay(told)
    item = Work([1, 2, 3], 4, [0], True, proposed=2, seq=object(), state_slot=3)
    runner.states = None  # an attention-only model keeps nothing: nothing to tell
    runner.accepted(item, 1)
    assert told.sent == []

    class Kept:
        def __init__(self) -> None:
            self.kept: list[tuple[int, int]] = []

        def keep(self, states: Any, slot: int, kept: int) -> None:
            self.kept.append((slot, kept))

    runner.states, runner._verify = object(), Kept()  # type: ignore[assignment]
    runner.accepted(item, 1)
    (message,) = told.sent
    assert isinstance(message, Accepted) and message.kept == 1 and message.item.seq is None
    assert message.item.state_slot == 3 and runner._verify.kept == [(3, 1)]  # type: ignore[attr-defined]


def test_a_follower_runs_rank_zeros_forwards_and_kept_proposals_in_order() -> None:
    done: list[tuple[str, object]] = []

    class Runner:
        device = torch.device("cpu")

        def execute(self, work: list[Work], fed: torch.Tensor | None) -> None:
            done.append(("execute", len(work)))

        def score(self, prompt: list[int], top_n: int, lora: object) -> None:
            done.append(("score", top_n))

        def accepted(self, item: Work, kept: int) -> None:
            done.append(("accepted", kept))

    item = Work([1, 2, 3], 4, [0], True, proposed=2)
    messages: list[Message] = [Execute([item], None), Accepted(item, 2), Score([1, 2], 1), Stop()]
    follow(Told(messages), Runner())  # type: ignore[arg-type]
    assert done == [("execute", 1), ("accepted", 2), ("score", 1)]
