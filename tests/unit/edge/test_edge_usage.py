"""UsageTracker: running usage from token ids, exact counts at finish, totals over calls."""

from __future__ import annotations

from edge_fakes import content, finished, started, usage

from edge.surfaces.shared.usage import UsageTracker, usage_dict
from sluice.v1 import worker_pb2


def counts(u: dict[str, int | dict[str, int]]) -> tuple[object, ...]:
    return (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])


def test_running_counts_token_ids_per_choice_then_takes_the_finished_count() -> None:
    tracker = UsageTracker()
    tracker.on_event(0, started(n=2, prompt_tokens=7))
    assert counts(tracker.running()) == (7, 0, 7)
    tracker.on_event(0, content("a b", index=0, token_ids=(1, 2)))
    tracker.on_event(0, content("c", index=1, token_ids=(3,)))
    assert counts(tracker.running()) == (7, 3, 10)
    # The worker's count also holds tokens that produced no text (EOS): it wins.
    tracker.on_event(0, finished(index=0, tokens=3))
    assert counts(tracker.running()) == (7, 4, 11)
    tracker.on_event(0, finished(index=1, tokens=1))
    tracker.on_event(0, usage(prompt=7, completion=4))
    assert counts(tracker.final()) == (7, 4, 11)


def test_final_sums_calls_and_prefers_their_usage_events() -> None:
    tracker = UsageTracker()
    tracker.on_event(0, started(prompt_tokens=3))
    tracker.on_event(1, started(prompt_tokens=5))
    tracker.on_event(0, finished(tokens=2))
    tracker.on_event(1, finished(tokens=9))
    tracker.on_event(0, usage(prompt=3, completion=2))
    tracker.on_event(
        1,
        worker_pb2.GenerateResponse(
            usage=worker_pb2.Usage(
                prompt_tokens=5, completion_tokens=4, total_tokens=9, cached_tokens=2, reasoning_tokens=1
            )
        ),
    )
    assert tracker.final() == usage_dict(8, 6, cached_tokens=2, reasoning_tokens=1)


def test_final_falls_back_when_a_call_sent_no_usage() -> None:
    tracker = UsageTracker()
    tracker.on_event(0, started(prompt_tokens=4))
    tracker.on_event(0, content("x", token_ids=(5,)))
    tracker.on_event(0, finished(tokens=6))
    assert counts(tracker.final()) == (4, 6, 10)


def test_usage_dict_shape() -> None:
    assert usage_dict(2, 3, 1, 0) == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
