"""The scheduler alone (no model): admission, chunked prefill, preemption over a block pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from worker.engine.kv_blocks import BlockManager
from worker.engine.scheduler import Scheduler, SchedulingFailed, SeqState
from worker.engine.stats import EngineCounters, EngineStats
from worker.errors import InvalidRequest, QueueFull
from worker.types import Scheduling


@dataclass(eq=False)
class Item:
    request_id: str
    sequences: list[SeqState] = field(default_factory=list)
    needs_kv: bool = True
    scheduling: Scheduling = field(default_factory=Scheduling)


def item(name: str, prompt: int, *, n: int = 1, max_tokens: int = 8) -> Item:
    tokens = [hash((name, i)) % 1000 for i in range(prompt)]
    return Item(
        name,
        [SeqState(list(tokens), prompt, prompt + max_tokens, awaits_prompt=i > 0) for i in range(n)],
    )


def scheduler(blocks: int = 64, size: int = 4, **options) -> Scheduler[Item]:
    settings = {"max_running": 4, "max_queue": 10, "prefill_budget_tokens": 100, **options}
    return Scheduler(BlockManager(blocks, size), **settings)


def run_step(s: Scheduler[Item]):
    """Plans a step and does what the engine does after a forward: commit, then one sample for each
    sequence that reached its end."""
    plan = s.schedule()
    sampled = [w.seq for w in plan.work if w.sample]
    for work in plan.work:
        s.committed(work)
    for seq in sampled:
        seq.tokens.append(7)
    return plan


def test_admits_in_arrival_order_up_to_max_running():
    s = scheduler(max_running=2)
    for name in "abc":
        s.add(item(name, 5))
    plan = run_step(s)
    assert [i.request_id for i in plan.started] == ["a", "b"] and [w.count for w in plan.work] == [5, 5]
    assert [i.request_id for i in s.waiting] == ["c"]
    plan = run_step(s)  # decode rows: one token each
    assert [w.count for w in plan.work] == [1, 1] and not plan.started


def test_a_finished_request_frees_its_slot_and_blocks():
    s = scheduler(max_running=1)
    first, second = item("a", 5), item("b", 5)
    s.add(first)
    s.add(second)
    run_step(s)
    used = s.blocks.used
    assert used == 2  # 5 tokens + the first sample's slot ahead: 2 blocks of 4
    s.finish(first.sequences[0])
    assert s.remove("a") is first and s.blocks.used == 0
    assert run_step(s).started == [second]


def test_queue_bound_raises_queue_full_with_retry_hint():
    s = scheduler(max_queue=2, max_running=1)
    for name in "abc":  # one for the free slot (the next step admits it), two waiting
        s.add(item(name, 3))
    with pytest.raises(QueueFull) as caught:
        s.add(item("d", 3))
    assert caught.value.retry_after_seconds > 0
    run_step(s)  # "a" runs: the slot is taken, two wait
    with pytest.raises(QueueFull):
        s.add(item("e", 3))


def test_long_prompts_are_chunked_and_running_streams_decode_every_step():
    s = scheduler(prefill_budget_tokens=10)
    short = item("short", 3)
    s.add(short)
    run_step(s)
    long = item("long", 25)
    s.add(long)
    counts = []
    for _ in range(3):
        plan = run_step(s)
        counts.append({w.seq.prompt_length: w.count for w in plan.work})
    # The running stream got a token in every step; the long prompt came in chunks of the budget.
    assert counts == [{3: 1, 25: 10}, {3: 1, 25: 10}, {3: 1, 25: 5}]
    assert long.sequences[0].generated == 1  # it sampled only when its last chunk ran
    assert [w.count for w in run_step(s).work] == [1, 1]


def test_the_first_admission_of_a_step_goes_through_even_when_the_budget_is_spent():
    s = scheduler(prefill_budget_tokens=4)
    s.add(item("a", 6))
    s.add(item("b", 6))
    plan = run_step(s)
    assert [w.count for w in plan.work] == [4] and [i.request_id for i in plan.started] == ["a"]


def test_cached_prefix_blocks_are_not_computed_again():
    s = scheduler(size=4)
    first = item("same", 13)
    s.add(first)
    run_step(s)
    s.finish(first.sequences[0])
    s.remove("same")
    again = item("same", 13)
    s.add(again)
    plan = run_step(s)
    seq = again.sequences[0]
    assert seq.cached_tokens == 12 and [w.count for w in plan.work] == [1]


def test_n_sequences_count_against_max_running_and_siblings_wait_for_the_prompt():
    s = scheduler(max_running=3)
    s.add(item("two", 5, n=2))
    s.add(item("two-more", 5, n=2))
    plan = run_step(s)
    assert [i.request_id for i in plan.started] == ["two"]
    assert len(plan.work) == 1  # the prompt once; the sibling waits for its first sample


def test_when_blocks_run_out_the_newest_request_is_preempted_and_recomputed_later():
    s = scheduler(blocks=6, size=4, max_running=4)
    old, new = item("old", 8, max_tokens=12), item("new", 8, max_tokens=12)
    s.add(old)
    s.add(new)
    run_step(s)  # both prompts: 2 blocks each, plus each sample's slot: 3 blocks each
    preempted = []
    for _ in range(10):
        plan = run_step(s)
        preempted += [i.request_id for i in plan.preempted]
    assert preempted == ["new"]
    assert old.sequences[0].generated == 11 and s.waiting[0] is new
    assert new.sequences[0].computed == 0 and new.sequences[0].generated >= 1  # keeps its tokens
    s.finish(old.sequences[0])
    s.remove("old")
    plan = run_step(s)
    # Re-admitted: every known token computed again in one chunk (what the prefix cache kept aside),
    # and the chunk's end sampled the next token.
    seq = new.sequences[0]
    assert plan.started == [new] and seq.computed == len(seq.tokens) - 1


def test_a_request_that_could_never_fit_the_pool_is_refused_at_once():
    s = scheduler(blocks=4, size=4)
    with pytest.raises(InvalidRequest, match="more than this worker's 16"):
        s.add(item("big", 10, max_tokens=10))
    with pytest.raises(InvalidRequest):
        s.add(item("two", 4, n=2, max_tokens=6))  # 2 x 10 tokens
    s.add(item("fits", 4, max_tokens=12))


def test_remove_finds_queued_and_running_and_ignores_unknown():
    s = scheduler(max_running=1)
    a, b = item("a", 3), item("b", 3)
    s.add(a)
    s.add(b)
    run_step(s)
    assert s.remove("b") is b and s.remove("a") is a and s.remove("zzz") is None
    assert not s.running and not s.waiting and s.blocks.used == 0


def started(name: str, prompt: int, generated: int, *, n: int, max_tokens: int = 40) -> Item:
    """An ``n``-choice request as a preemption leaves it: every choice has generated tokens, none has
    KV in the pool."""
    request = item(name, prompt, n=n, max_tokens=max_tokens)
    for index, seq in enumerate(request.sequences):
        seq.awaits_prompt = False
        seq.tokens += [900 + index] * generated
    return request


def test_a_preempted_n_request_whose_choices_exceed_the_budget_is_admitted_and_finishes():
    # Each choice has 12 tokens to compute again, the step's budget is 8: its first choice takes the
    # whole budget, so the second waits inside the batch instead of refusing the request every step.
    s = scheduler(blocks=64, size=4, max_running=8, prefill_budget_tokens=8)
    head, behind = started("head", 10, 2, n=3), item("behind", 5)
    s.add(head)
    s.add(behind)
    plan = run_step(s)
    assert plan.started == [head] and [w.count for w in plan.work] == [8]
    for _ in range(60):
        plan = run_step(s)
        if not s.waiting and all(seq.pending == 1 for seq in head.sequences):
            break
        assert plan.work, "work is waiting but the step planned nothing"
    assert behind in s.running and all(seq.pending == 1 for seq in head.sequences)


def test_a_waiting_request_is_refused_for_the_budget_only_when_other_requests_took_it():
    s = scheduler(blocks=64, size=4, max_running=8, prefill_budget_tokens=8)
    s.add(item("long", 20))
    s.add(started("n3", 10, 2, n=3))
    plan = run_step(s)  # "long" takes the whole budget: "n3" waits in the queue
    assert [i.request_id for i in plan.started] == ["long"] and len(s.waiting) == 1
    run_step(s)
    plan = run_step(s)  # the last 4 tokens of "long", then 4 of "n3"'s first choice
    assert [i.request_id for i in plan.started] == ["n3"] and [w.count for w in plan.work] == [4, 4]


def test_cached_tokens_are_counted_at_the_first_admission_even_with_generated_tokens():
    s = scheduler(blocks=64, size=4)
    first = item("first", 9)
    s.add(first)
    run_step(s)
    s.finish(first.sequences[0])
    s.remove("first")
    resumed = item("first", 9)  # the same prompt plus tokens generated elsewhere (a moved stream)
    resumed.sequences[0].tokens += [7, 8, 9]
    s.add(resumed)
    run_step(s)
    assert resumed.sequences[0].cached_tokens == 8  # the prompt's two whole blocks, never more


def test_a_request_with_more_choices_than_slots_is_refused_at_once():
    s = scheduler(max_running=2)
    with pytest.raises(InvalidRequest, match="at most 2 sequences") as caught:
        s.add(item("wide", 3, n=3))
    assert caught.value.param == "n"


def test_cached_tokens_are_the_tokens_reused_by_the_admission_that_succeeds():
    # A 5-block pool of 4-token blocks. "a"'s 9-token prompt leaves two registered blocks (8 tokens)
    # reusable; "b" then holds the other three blocks. A second "a" (the same prompt) attaches the
    # two cached blocks but finds no block for its last token, so it waits with nothing taken; "b"'s
    # next block evicts one of the two, and when "b" ends the second "a" is admitted reusing 4.
    s = scheduler(blocks=5, size=4)
    first = item("a", 9, max_tokens=2)
    s.add(first)
    run_step(s)
    s.finish(first.sequences[0])
    s.remove("a")
    holder = item("b", 11, max_tokens=4)
    s.add(holder)
    run_step(s)
    again = item("a", 9, max_tokens=2)
    s.add(again)
    assert run_step(s).started == []  # the attached prefix went back: the second "a" waits
    assert run_step(s).started == []  # "b" took a fifth block: one of the prefix's two is gone
    s.finish(holder.sequences[0])
    s.remove("b")
    plan = s.schedule()
    seq = again.sequences[0]
    assert plan.started == [again] and [w.count for w in plan.work] == [5]
    assert seq.computed == 4 and seq.cached_tokens == 4  # reported as reused: what was reused


def admission_raises_for(s: Scheduler[Item], bad: Item, monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes ``bad``'s admission take its blocks, then raise (a bug in planning that request)."""
    admit = s._start

    def failing(request: Item, budget: int, plan):  # type: ignore[no-untyped-def]
        result = admit(request, budget, plan)
        if request is bad:
            raise ValueError("admission bug")
        return result

    monkeypatch.setattr(s, "_start", failing)


def test_a_request_whose_admission_raised_is_named_when_planning_raises_afterwards(monkeypatch):
    s = scheduler()
    s.add(item("decoding", 5))
    run_step(s)
    bad = item("bad", 5)
    s.add(bad)
    admission_raises_for(s, bad, monkeypatch)

    def proposer_bug(request: Item, seq: SeqState, room: int) -> list[int]:
        raise RuntimeError("proposer bug")

    s.propose = proposer_bug  # runs after the admissions: the plan, and its failed list, are lost
    with pytest.raises(SchedulingFailed) as caught:
        s.schedule()
    assert [request for request, _ in caught.value.failed] == [bad]
    assert isinstance(caught.value.error, RuntimeError) and caught.value.__cause__ is caught.value.error
    assert bad not in s.waiting and bad not in s.running and not bad.sequences[0].blocks.table


def test_a_request_whose_admission_raised_is_named_when_freeing_its_blocks_raises(monkeypatch):
    s = scheduler()
    bad = item("bad", 5)
    s.add(bad)
    admission_raises_for(s, bad, monkeypatch)

    def reference_bug(blocks) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("block 3 released more often than it was taken")

    monkeypatch.setattr(s.blocks, "free", reference_bug)
    with pytest.raises(SchedulingFailed) as caught:
        s.schedule()
    assert [request for request, _ in caught.value.failed] == [bad] and not s.waiting


def test_each_planned_sequence_holds_a_state_slot_until_it_finishes_or_is_preempted():
    """A hybrid model's runner reads ``Work.state_slot``: distinct slots for the sequences running
    together; a preempted request gives its slots back and takes free ones when it starts again;
    finished and removed sequences give theirs back."""
    s = scheduler(blocks=6, size=4, max_running=3)
    old, new = item("old", 8, max_tokens=12), item("new", 8, max_tokens=12)
    s.add(old)
    s.add(new)
    plan = run_step(s)
    assert sorted(w.state_slot for w in plan.work) == [0, 1] and s.states.free == 1
    preempted = False
    while not preempted:
        plan = run_step(s)
        preempted = bool(plan.preempted)
    assert new.sequences[0].state_slot == -1 and s.states.free == 2
    assert [w.state_slot for w in plan.work] == [old.sequences[0].state_slot]
    s.finish(old.sequences[0])
    s.remove("old")
    assert s.states.free == 3
    plan = run_step(s)
    assert plan.started == [new] and plan.work[0].state_slot >= 0 and s.states.free == 2
    s.remove("new")
    assert s.states.free == 3


def test_a_hybrid_prompt_is_cut_at_its_checkpoint_and_a_later_one_resumes_there():
    """With state checkpoints (a hybrid model), a prompt's chunk ends at its last block boundary
    (12 of 13 tokens), whose state the step keeps; the same prompt later attaches only that far and
    resumes from the checkpoint; a prefix whose checkpoint was taken back is not reused at all."""
    s = scheduler(blocks=64, size=4, checkpoints=1)
    first = item("a", 13)
    s.add(first)
    plan = run_step(s)
    assert [(w.count, w.state_to) for w in plan.work] == [(12, 0)]
    plan = run_step(s)
    assert [(w.start, w.count, w.state_to) for w in plan.work] == [(12, 1, -1)]
    s.add(again := item("a", 13))
    plan = run_step(s)
    [work] = [w for w in plan.work if w.seq is again.sequences[0]]
    assert (work.start, work.state_from) == (12, 0) and again.sequences[0].cached_tokens == 12
    s.add(other := item("b", 9))  # its checkpoint (at 8) takes back the only one, a's
    run_step(s)
    s.add(third := item("a", 13))
    plan = run_step(s)
    [work] = [w for w in plan.work if w.seq is third.sequences[0]]
    assert (work.start, work.state_from) == (0, -1) and third.sequences[0].cached_tokens == 0
    assert other.sequences[0].computed > 0


def test_an_evicted_prefix_gives_its_checkpoint_back():
    s = scheduler(blocks=64, size=4, checkpoints=2)
    s.add(first := item("a", 13))
    run_step(s)
    assert s.checkpoints is not None and s.blocks.cached == 3 and s.checkpoints.bound == 1
    s.finish(first.sequences[0])
    s.remove("a")
    s.blocks.clear_cache()
    assert s.checkpoints.bound == 0


def test_starts_wait_while_the_running_set_holds_max_loras_adapters():
    from worker.types import LoraHandle

    one, two = LoraHandle("one", 1, 1, None), LoraHandle("two", 2, 1, None)
    s = scheduler(max_running=4)
    for name, adapter in (("a", one), ("b", one), ("c", two), ("d", None)):
        request = item(name, 5, max_tokens=1)
        request.sequences[0].lora = adapter
        s.add(request)
    plan = run_step(s)  # two of adapter "one": --max-loras 1 holds "two" (and, FIFO, "d") back
    assert [i.request_id for i in plan.started] == ["a", "b"]
    assert {w.lora for w in plan.work} == {one}
    stats = EngineStats.of(
        s, SimpleNamespace(pool_bytes=0, lora=SimpleNamespace(max_loras=1)), None, EngineCounters()
    )
    assert (stats.max_loras, stats.running_loras, stats.waiting_loras) == (1, ("one",), ("two",))
    for request in list(s.running):
        s.finish(request.sequences[0])
        s.remove(request.request_id)
    plan = run_step(s)
    assert [i.request_id for i in plan.started] == ["c", "d"]
    assert [w.lora for w in plan.work] == [two, None]
    # A prefix cached under one adapter is not found under another, nor under the base model.
    blocks = s.blocks
    prompt = [*range(40, 48), 0]  # two whole blocks, then the token whose logits are wanted
    seqs = {key: SeqState(list(prompt), 9, 10, lora=key) for key in (one, two, None)}
    assert blocks.ensure(seqs[one].blocks, 8)
    blocks.commit(seqs[one].blocks, seqs[one].cache_keys, 8)
    assert blocks.cached_length(seqs[one].cache_keys) == 8
    assert blocks.cached_length(seqs[two].cache_keys) == 0
    assert blocks.cached_length(seqs[None].cache_keys) == 0
