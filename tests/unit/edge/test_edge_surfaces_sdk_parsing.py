"""The SDKs' own stream accumulators, fed the translators' events (no server, no model): what the
openai and anthropic stream helpers assemble equals the non-streamed answer, for reasoning, text
and tool calls. The end-to-end tests repeat this over HTTP against the real model."""

from __future__ import annotations

from typing import Any

from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from edge_fakes import content, started
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from surface_fakes import counter_ids, finished_with, reasoning, tool_call, usage_with

from edge.surfaces.anthropic.translate import MessagesTranslator
from edge.surfaces.responses.request import parse_responses_request
from edge.surfaces.responses.translate import ResponsesTranslator
from sluice.v1 import worker_pb2

EVENTS = [
    started(prompt_tokens=7),
    reasoning("Hmm", 1),
    content("Let me check"),
    content("."),
    tool_call(0, '{"city":', "weather", "call_a"),
    tool_call(0, '"Paris"}'),
    finished_with(worker_pb2.TOOL_CALLS, 9),
    usage_with(7, 9, cached=2, reasoning_tokens=1),
]


def test_openai_stream_helper_assembles_the_non_streamed_response() -> None:
    echo = parse_responses_request(
        {"model": "m", "input": "x", "tools": [{"type": "function", "name": "weather"}], "temperature": 0}
    ).echo()
    streamed = ResponsesTranslator("resp_1", 1, "m", echo, new_id=counter_ids())
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    seen = []
    for event in EVENTS:
        for raw in streamed.on_event(0, event):
            seen += state.handle_event(construct_type(type_=ResponseStreamEvent, value=raw))  # type: ignore[arg-type]
    for raw in streamed.finish():
        seen += state.handle_event(construct_type(type_=ResponseStreamEvent, value=raw))  # type: ignore[arg-type]
    final = state._completed_response
    assert final is not None

    whole = ResponsesTranslator("resp_1", 1, "m", echo, new_id=counter_ids())
    for event in EVENTS:
        whole.add(0, event)
    expected = construct_type(type_=Response, value=whole.result())
    assert final.model_dump(exclude_none=True) == expected.model_dump(exclude_none=True)  # type: ignore[union-attr]
    assert final.output_text == "Let me check."
    call = final.output[2]
    assert call.type == "function_call" and call.arguments == '{"city":"Paris"}'
    snapshots = [e.snapshot for e in seen if e.type == "response.function_call_arguments.delta"]
    assert snapshots == ['{"city":', '{"city":"Paris"}']


def test_anthropic_accumulator_assembles_the_non_streamed_message() -> None:
    streamed = MessagesTranslator("msg_1", "m", new_id=counter_ids())
    snapshot = None
    buffers: dict[int, bytes] = {}
    raw_events = [raw for event in EVENTS for raw in streamed.on_event(0, event)] + streamed.finish()
    for raw in raw_events:
        event = construct_type(type_=RawMessageStreamEvent, value=raw)  # type: ignore[arg-type]
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)  # type: ignore[arg-type]
    assert snapshot is not None

    whole = MessagesTranslator("msg_1", "m", new_id=counter_ids())
    for event in EVENTS:
        whole.add(0, event)
    expected = Message.model_validate(whole.result())
    assert snapshot.model_dump(exclude_none=True) == expected.model_dump(exclude_none=True)
    assert [block.type for block in snapshot.content] == ["thinking", "text", "tool_use"]
    assert snapshot.content[2].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.output_tokens == 9
