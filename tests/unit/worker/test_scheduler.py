from dataclasses import dataclass

import pytest

from worker.errors import InvalidRequest, QueueFull
from worker.scheduler import Scheduler


@dataclass
class Item:
    request_id: str
    num_sequences: int = 1
    prompt_length: int = 10
    max_tokens: int = 10

    @property
    def reserved_tokens(self) -> int:
        return (self.prompt_length + self.max_tokens) * self.num_sequences


def test_admits_in_arrival_order_up_to_max_running():
    sched: Scheduler[Item] = Scheduler(
        max_running=2, max_queue=10, prefill_budget_tokens=1000, max_batch_tokens=10_000
    )
    for name in "abc":
        sched.add(Item(name))
    plan = sched.schedule()
    assert [i.request_id for i in plan.prefill] == ["a", "b"]
    assert plan.decode == []
    plan = sched.schedule()
    assert plan.prefill == [] and [i.request_id for i in plan.decode] == ["a", "b"]
    assert [i.request_id for i in sched.waiting] == ["c"]


def test_finished_request_frees_its_slot_for_the_next_step():
    sched: Scheduler[Item] = Scheduler(
        max_running=1, max_queue=10, prefill_budget_tokens=1000, max_batch_tokens=10_000
    )
    sched.add(Item("a"))
    sched.add(Item("b"))
    sched.schedule()
    assert sched.remove("a") is not None
    plan = sched.schedule()
    assert [i.request_id for i in plan.prefill] == ["b"]


def test_queue_bound_raises_queue_full_with_retry_hint():
    sched: Scheduler[Item] = Scheduler(
        max_running=1, max_queue=2, prefill_budget_tokens=1000, max_batch_tokens=10_000
    )
    sched.add(Item("a"))
    sched.add(Item("b"))
    with pytest.raises(QueueFull) as info:
        sched.add(Item("c"))
    assert info.value.retry_after_seconds and "queue is full" in info.value.message


def test_prefill_budget_limits_admissions_per_step_but_never_starves_a_long_prompt():
    sched: Scheduler[Item] = Scheduler(
        max_running=8, max_queue=10, prefill_budget_tokens=100, max_batch_tokens=10_000
    )
    sched.add(Item("long", prompt_length=500))
    sched.add(Item("short", prompt_length=50))
    plan = sched.schedule()
    assert [i.request_id for i in plan.prefill] == ["long"]  # alone, though over budget
    plan = sched.schedule()
    assert [i.request_id for i in plan.prefill] == ["short"]


def test_n_sequences_count_against_max_running():
    sched: Scheduler[Item] = Scheduler(
        max_running=4, max_queue=10, prefill_budget_tokens=1000, max_batch_tokens=10_000
    )
    sched.add(Item("a", num_sequences=3))
    sched.add(Item("b", num_sequences=2))
    assert [i.request_id for i in sched.schedule().prefill] == ["a"]
    assert sched.running_sequences == 3


def test_remove_finds_queued_and_running_and_ignores_unknown():
    sched: Scheduler[Item] = Scheduler(
        max_running=1, max_queue=10, prefill_budget_tokens=1000, max_batch_tokens=10_000
    )
    sched.add(Item("run"))
    sched.add(Item("wait"))
    sched.schedule()
    assert sched.remove("wait").request_id == "wait"
    assert sched.remove("run").request_id == "run"
    assert sched.remove("ghost") is None
    assert not sched.running and not sched.waiting


def test_prefill_budget_counts_padding_to_the_longest_new_prompt():
    sched: Scheduler[Item] = Scheduler(
        max_running=8, max_queue=10, prefill_budget_tokens=100, max_batch_tokens=10_000
    )
    sched.add(Item("a", prompt_length=10))
    sched.add(Item("b", prompt_length=45))  # 2 x 45 = 90 fits
    sched.add(Item("c", prompt_length=5))  # 3 x 45 = 135 does not
    assert [i.request_id for i in sched.schedule().prefill] == ["a", "b"]
    assert [i.request_id for i in sched.schedule().prefill] == ["c"]


def test_prefill_budget_uses_the_given_prefill_cost():
    cached = {"a": 40, "b": 40, "c": 0}  # prompt tokens a prefix cache already holds
    sched: Scheduler[Item] = Scheduler(
        max_running=8,
        max_queue=10,
        prefill_budget_tokens=100,
        max_batch_tokens=10_000,
        prefill_cost=lambda item: item.prompt_length - cached[item.request_id],
    )
    for name in "abc":
        sched.add(Item(name, prompt_length=45))
    # a and b cost 5 each (2 x 5 = 10 fits); c costs 45, so 3 x 45 = 135 does not.
    assert [i.request_id for i in sched.schedule().prefill] == ["a", "b"]
    assert [i.request_id for i in sched.schedule().prefill] == ["c"]


def test_token_reservations_bound_the_batch():
    sched: Scheduler[Item] = Scheduler(
        max_running=8, max_queue=10, prefill_budget_tokens=1000, max_batch_tokens=100
    )
    sched.add(Item("a", prompt_length=20, max_tokens=40))  # reserves 60
    sched.add(Item("b", prompt_length=20, max_tokens=30))  # 50 more would exceed 100
    assert [i.request_id for i in sched.schedule().prefill] == ["a"]
    assert sched.schedule().prefill == []
    sched.remove("a")
    assert [i.request_id for i in sched.schedule().prefill] == ["b"]


def test_a_request_that_can_never_fit_is_refused_at_once():
    sched: Scheduler[Item] = Scheduler(
        max_running=8, max_queue=10, prefill_budget_tokens=1000, max_batch_tokens=100
    )
    with pytest.raises(InvalidRequest) as info:
        sched.add(Item("huge", prompt_length=50, max_tokens=30, num_sequences=2))
    assert info.value.param == "max_tokens" and "160" in info.value.message
