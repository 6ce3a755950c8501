"""The one merge rule for a stream's consecutive deltas (sluice/coalesce.py), on the wire messages the
edge merges; the worker's side of it is tests/unit/worker/test_output_coalesce.py."""

from __future__ import annotations

from sluice.coalesce import merge_into
from sluice.v1 import worker_pb2 as pb


def content(text: str, index: int = 0, ids: tuple[int, ...] = (), logprobs: int = 0) -> pb.GenerateResponse:
    entries = [pb.TokenLogprob(token=f"{text}{i}", logprob=-float(i)) for i in range(logprobs)]
    return pb.GenerateResponse(
        content=pb.ContentDelta(choice_index=index, text=text, token_ids=ids, logprobs=entries)
    )


def tool(
    index: int, args: str, *, id: str = "", name: str = "", choice: int = 0, ids: tuple[int, ...] = ()
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        tool_call=pb.ToolCallDelta(
            choice_index=choice, tool_index=index, id=id, name=name, arguments=args, token_ids=ids
        )
    )


def test_content_of_one_choice_merges_text_token_ids_and_logprobs_in_order() -> None:
    waiting = content("Hel", ids=(1, 2), logprobs=2)
    assert merge_into(waiting, content("lo", ids=(3,), logprobs=1))
    assert waiting.content.text == "Hello" and list(waiting.content.token_ids) == [1, 2, 3]
    assert [e.token for e in waiting.content.logprobs] == ["Hel0", "Hel1", "lo0"]


def test_reasoning_and_refusal_merge_like_content() -> None:
    reasoning = pb.GenerateResponse(reasoning=pb.ReasoningDelta(text="a", token_ids=[1]))
    assert merge_into(reasoning, pb.GenerateResponse(reasoning=pb.ReasoningDelta(text="b", token_ids=[2])))
    assert reasoning.reasoning.text == "ab" and list(reasoning.reasoning.token_ids) == [1, 2]
    refusal = pb.GenerateResponse(refusal=pb.RefusalDelta(text="no"))
    assert merge_into(refusal, pb.GenerateResponse(refusal=pb.RefusalDelta(text="pe")))
    assert refusal.refusal.text == "nope"


def test_other_choices_kinds_and_events_are_never_merged() -> None:
    waiting = content("a")
    before = waiting.SerializeToString()
    reasoning = pb.GenerateResponse(reasoning=pb.ReasoningDelta(text="r"))
    finished = pb.GenerateResponse(finished=pb.Finished(reason=pb.STOP))
    for event in (content("b", index=1), reasoning, finished, tool(0, "{}")):
        assert not merge_into(waiting, event)
    assert waiting.SerializeToString() == before
    started = pb.GenerateResponse(started=pb.Started(model="m"))
    assert not merge_into(started, pb.GenerateResponse(started=pb.Started(model="m")))
    usage = pb.GenerateResponse(usage=pb.Usage(completion_tokens=1))
    assert not merge_into(usage, pb.GenerateResponse(usage=pb.Usage(completion_tokens=2)))
    progress = pb.GenerateResponse(progress=pb.Progress(fraction=0.5))
    assert not merge_into(progress, pb.GenerateResponse(progress=pb.Progress(fraction=0.7)))


def test_tool_call_argument_fragments_merge_but_a_new_call_keeps_its_own_first_delta() -> None:
    first = tool(0, '{"ci', id="call_1", name="get_weather")
    assert merge_into(first, tool(0, 'ty": "Oslo"}'))
    assert first.tool_call.id == "call_1" and first.tool_call.name == "get_weather"
    assert first.tool_call.arguments == '{"city": "Oslo"}'
    # A second call (its own id and name), another tool index or another choice: kept apart.
    assert not merge_into(first, tool(1, "{", id="call_2", name="get_time"))
    assert not merge_into(first, tool(1, "x"))
    assert not merge_into(first, tool(0, "x", choice=1))
    assert not merge_into(first, tool(0, "x", id="call_3"))
    assert first.tool_call.arguments == '{"city": "Oslo"}'


def test_a_delta_without_ids_never_merges_into_one_that_carries_ids() -> None:
    # Ids travel on the last delta of their tokens: "b" belongs to tokens whose ids come later, so
    # merged into "a" (which carries ids) a migrated stream would think "b" delivered and resend it.
    waiting = content("a", ids=(1,))
    assert not merge_into(waiting, content("b"))
    assert waiting.content.text == "a"
    assert not merge_into(tool(0, "{", ids=(1,)), tool(0, "}"))
    # The other way round, and with no ids at all, they merge.
    held = content("a")
    assert merge_into(held, content("b", ids=(2,)))
    assert held.content.text == "ab" and list(held.content.token_ids) == [2]
    plain = content("a")
    assert merge_into(plain, content("b")) and plain.content.text == "ab"
