"""A real worker process serving the default model, driven over real gRPC."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sluice.status import read_details
from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stub(default_worker):
    with grpc.insecure_channel(default_worker.address) as channel:
        yield pb_grpc.WorkerStub(channel)


def chat(text: str, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=text)]),
        sampling=pb.SamplingParams(**sampling),
    )


def kinds(events) -> list[str]:
    return [e.WhichOneof("event") for e in events]


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_stream_is_started_deltas_finished_usage(stub):
    events = list(stub.Generate(chat("What is the capital of France?", temperature=0, max_tokens=20)))
    order = kinds(events)
    assert order[0] == "started" and order[-1] == "usage"
    assert order[-2] == "finished" and order.count("finished") == 1
    assert set(order[1:-2]) == {"content"}
    started, usage = events[0].started, events[-1].usage
    assert started.model == "SmolLM2-135M-Instruct" and started.worker_id and started.prompt_tokens > 5
    text = "".join(e.content.text for e in events if e.HasField("content"))
    assert "Paris" in text
    assert usage.prompt_tokens == started.prompt_tokens
    assert usage.completion_tokens == events[-2].finished.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_repeated_prompt_reuses_its_prefix_and_reports_cached_tokens(stub, default_worker):
    before = default_worker.metrics()["sluice_worker_prefix_cache_hit_tokens_total"]
    request = chat("Name three prime numbers, please.", temperature=0, max_tokens=8)
    first, second = list(stub.Generate(request)), list(stub.Generate(request))
    usage = second[-1].usage
    # Every whole 8-token block but the one holding the last token (which is always computed).
    assert usage.prompt_tokens - 8 <= usage.cached_tokens < usage.prompt_tokens, usage
    texts = ["".join(e.content.text for e in events if e.HasField("content")) for events in (first, second)]
    assert texts[0] == texts[1]  # greedy: reuse changes nothing
    after = default_worker.metrics()["sluice_worker_prefix_cache_hit_tokens_total"]
    assert after - before == first[-1].usage.cached_tokens + usage.cached_tokens


def test_max_tokens_gives_length_and_stop_string_is_cut(stub):
    events = list(
        stub.Generate(chat("Count from 1 to 50, separated by commas.", temperature=0, max_tokens=6))
    )
    finished = events[-2].finished
    assert finished.reason == pb.LENGTH and finished.completion_tokens == 6
    full = "".join(
        e.content.text
        for e in list(
            stub.Generate(chat("Count from 1 to 50, separated by commas.", temperature=0, max_tokens=40))
        )
        if e.HasField("content")
    )
    stop = "5"
    assert stop in full
    events = list(
        stub.Generate(
            chat("Count from 1 to 50, separated by commas.", temperature=0, max_tokens=40, stop=[stop])
        )
    )
    text = "".join(e.content.text for e in events if e.HasField("content"))
    assert stop not in text and full.startswith(text)
    assert events[-2].finished.reason == pb.STOP and events[-2].finished.matched_stop == stop


def test_raw_prompt_and_token_ids(stub):
    events = list(
        stub.Generate(
            pb.GenerateRequest(
                prompt=pb.PromptInput(text="The capital of France is"),
                sampling=pb.SamplingParams(temperature=0, max_tokens=5),
                echo_prompt=True,
            )
        )
    )
    assert events[0].started.prompt_text == "The capital of France is"
    ids = list(
        stub.Generate(
            pb.GenerateRequest(
                prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=[504, 3575, 282])),
                sampling=pb.SamplingParams(max_tokens=3, temperature=0),
            )
        )
    )
    assert ids[0].started.prompt_tokens == 3 and ids[-1].usage.completion_tokens >= 1


@pytest.mark.parametrize(
    ("request_", "code", "param"),
    [
        (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
        (pb.GenerateRequest(chat=pb.ChatInput()), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
        (
            pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="wizard", content="x")])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "messages[0].role",
        ),
        (chat("hi", temperature=3), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (chat("hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (chat("hi", max_tokens=100_000), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (chat("word " * 9000), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
        (pb.GenerateRequest(model="no-such-model", chat=chat("hi").chat), grpc.StatusCode.NOT_FOUND, "model"),
    ],
)
def test_bad_requests_fail_before_any_event_naming_the_problem(stub, request_, code, param):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request_))
    details = read_details(info.value)
    assert details.code == code and details.param == param and details.message


def test_cancelled_call_stops_generation(stub, default_worker):
    before = default_worker.metrics()
    call = stub.Generate(chat("Write a very long story about a dragon.", max_tokens=2000, ignore_eos=True))
    received = 0
    for event in call:
        received += event.HasField("content")
        if received == 3:
            call.cancel()
            break
    assert wait_for(
        lambda: (
            default_worker.metrics()["sluice_worker_requests_cancelled_total"]
            == before["sluice_worker_requests_cancelled_total"] + 1
        )
    )
    after = default_worker.metrics()
    assert after["sluice_worker_running_sequences"] == 0 and after["sluice_worker_live_caches"] == 0
    generated = after["sluice_worker_generated_tokens_total"] - before["sluice_worker_generated_tokens_total"]
    assert generated < 20, f"{generated} tokens generated for a call cancelled after 3"
    time.sleep(0.5)  # and it stays stopped
    assert (
        default_worker.metrics()["sluice_worker_generated_tokens_total"]
        == after["sluice_worker_generated_tokens_total"]
    )


def test_deadline_ends_the_call_and_frees_the_sequence(stub, default_worker):
    before = default_worker.metrics()["sluice_worker_requests_cancelled_total"]
    with pytest.raises(grpc.RpcError) as info:
        list(
            stub.Generate(
                chat("Tell me everything about the ocean.", max_tokens=2000, ignore_eos=True), timeout=1.0
            )
        )
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: default_worker.metrics()["sluice_worker_requests_cancelled_total"] == before + 1)
    assert default_worker.metrics()["sluice_worker_running_sequences"] == 0


def test_list_models_health_and_reflection(default_worker, stub):
    reply = stub.ListModels(pb.ListModelsRequest())
    assert [m.id for m in reply.models] == ["SmolLM2-135M-Instruct"]
    assert reply.models[0].context_length == 8192 and reply.worker_id
    with grpc.insecure_channel(default_worker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "sluice.v1.Worker"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert {"sluice.v1.Worker", "grpc.health.v1.Health"} <= names


def test_tokenize_counts_generates_prompt_and_detokenize_inverts_it(stub, default_worker):
    conversation = chat("Name three colours.").chat
    counted = stub.Tokenize(pb.TokenizeRequest(chat=conversation, return_token_strs=True))
    events = list(
        stub.Generate(pb.GenerateRequest(chat=conversation, sampling=pb.SamplingParams(max_tokens=1)))
    )
    assert counted.count == len(counted.ids) == len(counted.token_strs) == events[0].started.prompt_tokens
    assert counted.max_model_len > 0 and counted.worker_id == events[0].started.worker_id
    text = "Tokens, and back again."
    ids = stub.Tokenize(pb.TokenizeRequest(prompt=pb.PromptInput(text=text))).ids
    assert stub.Detokenize(pb.DetokenizeRequest(ids=ids)).text == text
    for call, request_, param in (
        (stub.Tokenize, pb.TokenizeRequest(), "prompt"),
        (stub.Tokenize, pb.TokenizeRequest(prompt=pb.PromptInput(text="x", suffix="y")), "suffix"),
        (stub.Detokenize, pb.DetokenizeRequest(ids=[1, 10**8]), "tokens"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call(request_)
        details = read_details(info.value)
        assert (details.code, details.param) == (grpc.StatusCode.INVALID_ARGUMENT, param)
    with grpc.insecure_channel(default_worker.address) as channel:
        raw = channel.unary_unary("/sluice.v1.Worker/Tokenize")
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\x12\x05\x0a\x03\x0a\x01\xff")  # chat.messages[0].role: invalid UTF-8
        assert read_details(info.value).param == "request"
