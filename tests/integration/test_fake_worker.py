"""A real worker process in fake-token mode (``--fake-tokens``), over real gRPC and through a real edge."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable

import grpc
import httpx
import pytest

from sluice.client import WorkerClient
from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import EdgeProcess, WorkerProcess
from worker.model.fake_runner import PASSAGE, SOURCE_PREFIX

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fake_worker(model_cache, tmp_path_factory):
    with WorkerProcess(
        cache_dir=model_cache,
        log_dir=tmp_path_factory.mktemp("fake-worker-log"),
        extra=["--fake-tokens", "--max-running", "64"],
    ) as worker:
        yield worker


@pytest.fixture(scope="module")
def stub(fake_worker):
    with grpc.insecure_channel(fake_worker.address) as channel:
        yield pb_grpc.WorkerStub(channel)


def chat(max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Tell me about the town.")]),
        sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling),
    )


def test_list_models_and_logs_say_fake(stub, fake_worker):
    reply = stub.ListModels(pb.ListModelsRequest())
    assert [m.id for m in reply.models] == ["SmolLM2-135M-Instruct"]
    assert reply.models[0].source.startswith(SOURCE_PREFIX)
    assert "FAKE TOKENS" in fake_worker.log_tail(200)


def test_stream_has_the_normal_shape_and_the_passage(stub):
    events = list(stub.Generate(chat(50, temperature=0)))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds[-2:] == ["finished", "usage"]
    assert set(kinds[1:-2]) == {"content"}
    finished, usage = events[-2].finished, events[-1].usage
    assert finished.reason == pb.LENGTH and finished.completion_tokens == 50
    assert usage.completion_tokens == 50 and usage.prompt_tokens == events[0].started.prompt_tokens > 5
    text = "".join(e.content.text for e in events if e.HasField("content"))
    assert len(text) > 100 and PASSAGE.startswith(text)


def test_stop_string_and_sampling_options_take_the_normal_path(stub):
    events = list(stub.Generate(chat(100, temperature=1.0, top_p=0.9, stop=["mill"])))
    text = "".join(e.content.text for e in events if e.HasField("content"))
    assert text == "The river ran quietly past the old "
    assert events[-2].finished.reason == pb.STOP and events[-2].finished.matched_stop == "mill"


def test_many_concurrent_streams_all_finish(fake_worker):
    async def one(stub: pb_grpc.WorkerStub) -> int:
        tokens = 0
        async for event in stub.Generate(chat(64, temperature=0), timeout=30):
            if event.HasField("finished"):
                tokens = event.finished.completion_tokens
        return tokens

    async def run() -> list[int]:
        async with grpc.aio.insecure_channel(fake_worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            return await asyncio.gather(*(one(stub) for _ in range(48)))

    started = time.monotonic()
    counts = asyncio.run(run())
    elapsed = time.monotonic() - started
    print(f"48 fake streams x 64 tokens in {elapsed:.2f}s ({48 * 64 / elapsed:.0f} tokens/s)")
    assert counts == [64] * 48
    assert elapsed < 30  # a functional bound: no stream hangs


def test_a_caller_that_stops_reading_gets_the_waiting_steps_merged(fake_worker, stub):
    """The shared client's small receive window (``sluice.client.STREAM_WINDOW_BYTES``) stops the
    worker's sends once a caller stops reading; every step generated meanwhile then arrives merged:
    a few messages of many tokens, the same text and token ids as one message per token."""
    max_tokens = 400
    request = chat(max_tokens, temperature=0)
    request.return_token_ids = True

    def generated() -> float:
        return fake_worker.metrics()["sluice_worker_generated_tokens_total"]

    async def body() -> list[pb.GenerateResponse]:
        client = WorkerClient(fake_worker.address)
        before = generated()
        try:
            async with client.generate(request, timeout=120) as call:
                events = aiter(call)
                first = await anext(events)
                for _ in range(2400):  # read nothing more until the whole answer was generated
                    if generated() >= before + max_tokens:
                        break
                    await asyncio.sleep(0.05)
                return [first] + [event async for event in events]
        finally:
            await client.close()

    events = asyncio.run(body())
    contents = [e.content for e in events if e.HasField("content")]
    assert sum(len(c.token_ids) for c in contents) == max_tokens
    assert events[-2].finished.reason == pb.LENGTH
    read_at_once = [e.content for e in stub.Generate(request) if e.HasField("content")]
    assert "".join(c.text for c in contents) == "".join(c.text for c in read_at_once)
    assert [t for c in contents for t in c.token_ids] == [t for c in read_at_once for t in c.token_ids]
    # One message per token (or per two, at full speed) without the window; a few dozen with it.
    assert len(contents) < max_tokens // 4


def test_metrics_mark_the_worker_fake_and_count_tokens(fake_worker, stub):
    before = fake_worker.metrics()["sluice_worker_generated_tokens_total"]
    list(stub.Generate(chat(10)))
    after = fake_worker.metrics()
    assert after["sluice_worker_fake_tokens"] == 1
    assert after["sluice_worker_generated_tokens_total"] == before + 10


def test_streams_through_an_edge(fake_worker, tmp_path):
    with EdgeProcess([fake_worker.address], log_dir=tmp_path) as edge:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 30,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{edge.base_url}/v1/chat/completions", json=body, timeout=30) as reply:
            assert reply.status_code == 200
            lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert PASSAGE.startswith(text) and len(text) > 50
    assert chunks[-1]["usage"]["completion_tokens"] == 30


def test_a_stream_interval_sends_fewer_messages_of_the_same_tokens(fake_worker, stub, model_cache, tmp_path):
    """``--stream-interval 4``: the same text, token ids, stop-string cut and usage as one message per
    step, in about a quarter of the messages (the first token alone, the end at once)."""
    stopped = chat(100, temperature=0, stop=["mill"])
    full = chat(49, temperature=0)
    full.return_token_ids = True
    with (
        WorkerProcess(
            cache_dir=model_cache,
            log_dir=tmp_path,
            extra=["--fake-tokens", "--fake-step-ms", "2", "--stream-interval", "4"],
        ) as paced_worker,
        grpc.insecure_channel(paced_worker.address) as channel,
    ):
        paced = pb_grpc.WorkerStub(channel)
        for request in (full, stopped):
            every_step = list(stub.Generate(request))
            grouped = list(paced.Generate(request))
            for events in (every_step, grouped):
                assert events[0].HasField("started") and events[-1].HasField("usage")
            ended, expected = grouped[-2].finished, every_step[-2].finished
            assert (ended.reason, ended.completion_tokens, ended.matched_stop) == (
                expected.reason,
                expected.completion_tokens,
                expected.matched_stop,
            )
            assert grouped[-1].usage.completion_tokens == every_step[-1].usage.completion_tokens

            assert "".join(c.text for c in content(grouped)) == "".join(c.text for c in content(every_step))
            ids = [t for c in content(grouped) for t in c.token_ids]
            assert ids == [t for c in content(every_step) for t in c.token_ids]
        # 49 tokens: the first alone, then 48 in twelve messages of four (the last with the end).
        assert len(content(paced.Generate(full))) <= 13


def test_a_requests_stream_interval_sends_fewer_messages_of_the_same_tokens(model_cache, tmp_path):
    """``stream_interval_ms``: the same text, token ids, end and usage as the same request without
    it (one message per 5 ms step), in a handful of messages with a window of 200 ms; a window
    over a second is refused, naming the field."""
    plain = chat(49, temperature=0)
    plain.return_token_ids = True
    paced = pb.GenerateRequest()
    paced.CopyFrom(plain)
    paced.stream_interval_ms = 200
    with (
        WorkerProcess(
            cache_dir=model_cache, log_dir=tmp_path, extra=["--fake-tokens", "--fake-step-ms", "5"]
        ) as worker,
        grpc.insecure_channel(worker.address) as channel,
    ):
        stub = pb_grpc.WorkerStub(channel)
        every_step, grouped = list(stub.Generate(plain)), list(stub.Generate(paced))
        paced.stream_interval_ms = 1001
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(paced))
    assert grouped[0].HasField("started") and grouped[-1].HasField("usage")
    ended, expected = grouped[-2].finished, every_step[-2].finished
    assert (ended.reason, ended.completion_tokens) == (expected.reason, expected.completion_tokens)
    used, reference = grouped[-1].usage, every_step[-1].usage  # the second one found the prompt cached
    assert (used.prompt_tokens, used.completion_tokens) == (
        reference.prompt_tokens,
        reference.completion_tokens,
    )
    assert "".join(c.text for c in content(grouped)) == "".join(c.text for c in content(every_step))
    ids = [t for c in content(grouped) for t in c.token_ids]
    assert ids == [t for c in content(every_step) for t in c.token_ids] and len(ids) == 49
    # 49 steps of at least 5 ms: at most one message per 200 ms after the first token's own.
    assert len(content(every_step)) > 25 and len(content(grouped)) < 8
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream_interval_ms" in refused.value.details()


def content(events: Iterable[pb.GenerateResponse]) -> list[pb.ContentDelta]:
    return [e.content for e in events if e.HasField("content")]
