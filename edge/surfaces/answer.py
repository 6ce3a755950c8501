"""The one translator protocol every surface implements, and the one answer path on it.

A route parses its body, builds its worker requests and calls :func:`generate`, which opens
the calls, answers one JSON body or a stream, and cancels the calls if anything fails first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from quart.wrappers import Response

from edge.errors import EdgeError
from edge.http import current_request_id, json_response
from edge.logs import log_record
from edge.request_log import RequestRecord
from edge.state import current_state
from edge.streaming import sse
from edge.streaming.pump import StreamFraming
from edge.surfaces.generation import collect, open_calls, response_headers, sse_response
from edge.surfaces.images import prepare_images
from edge.surfaces.shared.ids import new_id
from edge.surfaces.shared.rewrite import ParsedRequest
from edge.surfaces.shared.sampling import SamplingRequest
from edge.surfaces.shared.worker_request import call_metadata, to_generate_request
from edge.workers.call_group import CallGroup
from sluice.v1 import worker_pb2


class Translator(Protocol):
    """One response's worker events → one surface's answer (events tagged with their call's index).

    Streamed: :meth:`on_event` for every event, then :meth:`finish`, or :meth:`on_error` after a
    failure. Not streamed: :meth:`add` for every event, then :meth:`result`.
    """

    def on_event(self, call: int, event: worker_pb2.GenerateResponse) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...

    def on_error(self, error: EdgeError) -> list[dict[str, Any]]: ...

    def add(self, call: int, event: worker_pb2.GenerateResponse) -> None: ...

    def result(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Framing:
    """How a surface's stream looks on the wire: ``encode`` frames an event, ``error_encode`` an
    error event; ``end`` follows a good stream, ``error_end`` a failed one; ``heartbeat`` fills
    a silence; ``surface`` labels the stream metrics."""

    surface: str
    encode: Callable[[Any], bytes]
    error_encode: Callable[[Any], bytes]
    end: bytes
    error_end: bytes
    heartbeat: bytes = sse.HEARTBEAT_FRAME

    def for_stream(self, translator: Translator) -> StreamFraming:
        """The pump's framing for one stream, whose error frames are ``translator``'s."""

        def error_frames(error: EdgeError) -> bytes:
            return b"".join(self.error_encode(event) for event in translator.on_error(error)) + self.error_end

        return StreamFraming(
            encode=self.encode,
            heartbeat=self.heartbeat,
            end=self.end,
            error=error_frames,
            surface=self.surface,
        )


#: OpenAI's chat and completions streams: ``data:`` chunks, ``event: error``, ``data: [DONE]``.
OPENAI = Framing("openai", sse.data_frame, sse.error_frame, sse.DONE_FRAME, sse.DONE_FRAME)


def named_events(surface: str, heartbeat: bytes = sse.HEARTBEAT_FRAME) -> Framing:
    """Named events (``event: <type>``) and no ``[DONE]``: Responses, Anthropic, native."""
    return Framing(surface, sse.named_frame, sse.named_frame, b"", b"", heartbeat)


#: Called with a surface's final answer (stored Responses): awaited before a JSON body is sent; for
#: a stream, started as its last events are made (a stream that fails or is left is not passed on).
OnResult = Callable[[dict[str, Any]], Coroutine[Any, Any, None]]


async def answer(
    group: CallGroup,
    translator: Translator,
    headers: dict[str, str],
    *,
    stream: bool,
    framing: Framing,
    on_result: OnResult | None = None,
) -> Response:
    """The answer of an opened ``group``: one JSON body (:meth:`Translator.result`) or the stream."""
    record = log_record()
    if record is not None:
        translator = _Logged(translator, record)
    if not stream:
        await collect(group, translator.add)
        result = translator.result()
        if record is not None:
            record.response_id = result.get("id")
        if on_result is not None:
            await on_result(result)
        return json_response(result, headers=headers)
    finish = translator.finish
    if on_result is not None:
        finish = _finish_then(translator, on_result)
    return sse_response(group, translator.on_event, finish, headers, framing=framing.for_stream(translator))


@dataclass
class _Logged:
    """A translator whose events also fill the request's log record (``--log-requests``)."""

    inner: Translator
    record: RequestRecord

    def on_event(self, call: int, event: worker_pb2.GenerateResponse) -> list[dict[str, Any]]:
        self.record.on_event(call, event)
        chunks = self.inner.on_event(call, event)
        if self.record.response_id is None and chunks:
            self.record.response_id = _answer_id(chunks[0])
        return chunks

    def finish(self) -> list[dict[str, Any]]:
        return self.inner.finish()

    def on_error(self, error: EdgeError) -> list[dict[str, Any]]:
        return self.inner.on_error(error)

    def add(self, call: int, event: worker_pb2.GenerateResponse) -> None:
        self.record.on_event(call, event)
        self.inner.add(call, event)

    def result(self) -> dict[str, Any]:
        return self.inner.result()


def _answer_id(chunk: Any) -> str | None:
    """The answer's id in a surface's first stream event (a chat chunk's ``id``, the Response's
    or the Anthropic message's inside its first event)."""
    if not isinstance(chunk, dict):
        return None
    for holder in (chunk, chunk.get("response"), chunk.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("id"), str):
            return str(holder["id"])
    return None


def _finish_then(translator: Translator, on_result: OnResult) -> Callable[[], list[dict[str, Any]]]:
    """``translator.finish`` that then starts ``on_result`` with the result, in a task of its own
    (the stream's body cannot wait for it)."""
    background, key = current_state().background, f"result {current_request_id()}"

    def finish() -> list[dict[str, Any]]:
        events = translator.finish()
        background.spawn(key, on_result(translator.result()))
        return events

    return finish


async def generate(
    requests: Sequence[worker_pb2.GenerateRequest],
    translator: Callable[[str], Translator],
    *,
    model: str,
    stream: bool,
    framing: Framing,
    metadata: Sequence[tuple[str, str | bytes]] = (),
    load_events: bool = False,
    on_result: OnResult | None = None,
) -> Response:
    """Opens the calls (:func:`~edge.surfaces.generation.open_calls`), builds the translator for
    the model that answers (the worker's name for it, else ``model``) and answers; a failure or
    cancellation before the answer is committed cancels every call."""
    record = log_record()
    if record is not None:
        record.on_requests(requests)
    group = await open_calls(requests, metadata, load_events=load_events)
    try:
        built = translator(group.started(0).model or model)
        return await answer(
            group, built, response_headers(group), stream=stream, framing=framing, on_result=on_result
        )
    except BaseException:
        group.cancel()
        raise


async def generate_openai(
    requests: Sequence[worker_pb2.GenerateRequest],
    request: SamplingRequest,
    translator: Callable[..., Translator],
    id_prefix: str,
    **options: Any,
) -> Response:
    """:func:`generate` for chat and completions: the translator gets a ``<id_prefix>-…`` id, the
    creation time, the model, the request's usage options and ``options``."""
    return await generate(
        requests,
        lambda model: translator(
            new_id(id_prefix, "-"),
            int(time.time()),
            model,
            include_usage=request.include_usage,
            continuous_usage=request.continuous_usage,
            **options,
        ),
        model=request.model,
        stream=request.stream,
        framing=OPENAI,
    )


async def generate_rewritten(
    parsed: ParsedRequest[Any],
    translator: Callable[[str], Translator],
    framing: Framing,
    *,
    load_events: bool = False,
    on_result: OnResult | None = None,
) -> Response:
    """:func:`generate` for a surface rewritten as a chat request (Responses, Anthropic, native):
    one worker call, with the request id in its metadata."""
    request_id = current_request_id()
    await prepare_images(parsed.chat)
    worker_request = to_generate_request(parsed.chat, request_id)
    return await generate(
        [worker_request],
        translator,
        model=parsed.chat.model,
        stream=parsed.stream,
        framing=framing,
        metadata=call_metadata(parsed.chat, request_id),
        load_events=load_events,
        on_result=on_result,
    )


async def run_rewritten(
    parsed: ParsedRequest[Any],
    translator: Callable[[str], Translator],
    sink: Callable[[list[dict[str, Any]]], None] | None = None,
) -> dict[str, Any]:
    """A rewritten request run to its end with no HTTP answer (background Responses): the
    translator's result; raises :class:`~edge.errors.EdgeError` as :func:`generate` would. With a
    ``sink``, the stream events go to it as they are made (a failure's too, before the raise)."""
    request_id = current_request_id()
    await prepare_images(parsed.chat)
    worker_request = to_generate_request(parsed.chat, request_id)
    group = await open_calls([worker_request], call_metadata(parsed.chat, request_id))
    try:
        built = translator(group.started(0).model or parsed.chat.model)
        if sink is None:
            await collect(group, built.add)
        else:
            await _collect_into(group, built, sink)
        return built.result()
    except BaseException:
        group.cancel()
        raise


async def _collect_into(
    group: CallGroup, built: Translator, sink: Callable[[list[dict[str, Any]]], None]
) -> None:
    """Feeds ``group``'s events to ``built`` as a stream, its events (the last, or a failure's)
    to ``sink``."""
    try:
        await collect(group, lambda call, event: sink(built.on_event(call, event)))
    except EdgeError as error:
        sink(built.on_error(error))
        raise
    sink(built.finish())
