import grpc
import pytest

from sluice.status import read_details
from sluice.v1 import worker_pb2 as pb
from worker.errors import InvalidRequest, ModelNotFound, WorkerError
from worker.service.convert import event_to_proto, parse_request, sampling_options, truncated_prompt
from worker.types import ContentDelta, Finished, FinishReason, Scheduling, TokenLogprob, TopLogprob, Usage

MODEL = "SmolLM2-135M-Instruct"


def chat(*messages: pb.ChatMessage, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatInput(messages=list(messages)), **kw)


def user(text: str = "hi") -> pb.ChatMessage:
    return pb.ChatMessage(role="user", content=text)


def param_of(call) -> str | None:
    with pytest.raises(WorkerError) as info:
        call()
    return info.value.param


def test_parses_chat_messages():
    parsed = parse_request(chat(pb.ChatMessage(role="system", content="be brief"), user("hello")), MODEL)
    assert [(m.role, m.content) for m in parsed.prompt.messages] == [
        ("system", "be brief"),
        ("user", "hello"),
    ]


def test_priority_tenant_and_the_calls_deadline_become_the_requests_scheduling():
    parsed = parse_request(chat(user(), priority=-4, tenant="team-a"), MODEL, deadline=12.5)
    assert parsed.scheduling == Scheduling(priority=-4, tenant="team-a", deadline=12.5)
    assert parse_request(chat(user()), MODEL).scheduling == Scheduling()
    assert param_of(lambda: parse_request(chat(user(), tenant="x" * 257), MODEL)) == "tenant"


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (pb.GenerateRequest(), "messages"),
        (chat(), "messages"),
        (chat(pb.ChatMessage(role="robot", content="x")), "messages[0].role"),
        (chat(user(), pb.ChatMessage(role="user")), "messages[1].content"),
        (chat(pb.ChatMessage(role="tool", content="42")), "messages[0].tool_call_id"),
    ],
)
def test_bad_requests_name_the_field(request_, param):
    assert param_of(lambda: parse_request(request_, MODEL)) == param


def test_unknown_model_is_not_found():
    with pytest.raises(ModelNotFound) as info:
        parse_request(chat(user(), model="gpt-9"), MODEL)
    assert info.value.code == grpc.StatusCode.NOT_FOUND and "gpt-9" in info.value.message


def options(**fields):
    return sampling_options(
        pb.SamplingParams(**fields), prompt_tokens=10, context_length=100, vocab_size=1000
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 91}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"logprobs": 21}, "top_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {5000: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"stop_token_ids": [1000]}, "stop_token_ids"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
        ({"top_k": -2}, "top_k"),
        # The extremes of each proto type (int32, uint64, float): refused naming the field, never a crash.
        ({"max_tokens": 2**31 - 1}, "max_tokens"),
        ({"max_tokens": -(2**31)}, "max_tokens"),
        ({"n": 2**31 - 1}, "n"),
        ({"n": -(2**31)}, "n"),
        ({"logprobs": -1}, "top_logprobs"),
        ({"logprobs": 2**31 - 1}, "top_logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2**31 - 1}, "min_tokens"),
        ({"top_k": -(2**31)}, "top_k"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {2**31 - 1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"stop_token_ids": [-(2**31)]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("-inf")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"allowed_token_ids": [5, 1000]}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": ["ok", " "]}, "bad_words"),
        ({"bad_words": ["w"] * 257}, "bad_words"),
    ],
)
def test_out_of_range_sampling_names_the_field(fields, param):
    assert param_of(lambda: options(**fields)) == param


def test_the_largest_values_that_are_allowed_pass():
    allowed = options(top_k=2**31 - 1, seed=2**64 - 1, max_tokens=90, min_tokens=90, n=16, logprobs=20)
    assert (allowed.top_k, allowed.seed, allowed.max_tokens, allowed.n) == (2**31 - 1, 2**64 - 1, 90, 16)


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (
            pb.GenerateRequest(
                chat=pb.ChatInput(
                    messages=[user()], tools=[pb.Tool(name="f")], tool_choice=pb.ToolChoice(mode=9)
                )
            ),
            "tool_choice",
        ),
        (
            pb.GenerateRequest(
                chat=pb.ChatInput(messages=[user()], tools=[pb.Tool(name="f", parameters_json=nested(65))])
            ),
            "tools[0].function.parameters",
        ),
        (
            pb.GenerateRequest(
                chat=pb.ChatInput(messages=[user()], tools=[pb.Tool(name="f", parameters_json=nested(5000))])
            ),
            "tools[0].function.parameters",
        ),
        (
            pb.GenerateRequest(chat=pb.ChatInput(messages=[user()], chat_template_kwargs_json=nested(500))),
            "chat_template_kwargs",
        ),
        (
            pb.GenerateRequest(
                chat=pb.ChatInput(messages=[user()]),
                response_format=pb.ResponseFormat(json_schema=pb.JsonSchema(schema_json=nested(100))),
            ),
            "response_format.json_schema.schema",
        ),
    ],
)
def test_unknown_enums_and_deep_json_are_invalid_arguments(request_, param):
    with pytest.raises(InvalidRequest) as info:
        parse_request(request_, MODEL)
    assert info.value.param == param


def test_json_nested_up_to_the_bound_is_accepted():
    request = pb.GenerateRequest(
        chat=pb.ChatInput(messages=[user()], tools=[pb.Tool(name="f", parameters_json=nested(63))])
    )
    assert parse_request(request, MODEL).prompt.tools[0]["name"] == "f"


def test_undecodable_bytes_become_an_invalid_argument_naming_the_request():
    from worker.service.wire_decoding import UndecodableRequest, lenient_decoder

    decode = lenient_decoder(pb.GenerateRequest)
    good = pb.GenerateRequest(model="m").SerializeToString()
    assert decode(good).model == "m"
    bad = decode(b"\x12\x02\xff\xfe")  # field 2 (model), a string, holding invalid UTF-8
    assert isinstance(bad, UndecodableRequest)
    error = bad.error()
    assert (error.code, error.param) == (grpc.StatusCode.INVALID_ARGUMENT, "request")
    assert isinstance(decode(b"\x0a\xff"), UndecodableRequest)  # truncated


def test_unset_differs_from_zero():
    assert options().temperature == 1.0
    assert options(temperature=0.0).greedy


def test_max_tokens_defaults_to_the_room_left_in_the_context():
    assert options().max_tokens == 90
    assert (
        sampling_options(
            pb.SamplingParams(), prompt_tokens=10, context_length=100, vocab_size=10, default_max_tokens=20
        ).max_tokens
        == 20
    )


def test_prompt_filling_the_context_is_rejected():
    with pytest.raises(InvalidRequest) as info:
        sampling_options(pb.SamplingParams(), prompt_tokens=100, context_length=100, vocab_size=10)
    assert "context length is 100" in info.value.message


def test_error_status_round_trips_through_details():
    status = InvalidRequest("temperature must be in [0, 2]", param="temperature").to_status()

    class FakeRpcError(grpc.RpcError):
        def code(self):
            return status.code

        def details(self):
            return status.details

        def trailing_metadata(self):
            return status.trailing_metadata

    details = read_details(FakeRpcError())
    assert (details.code, details.param, details.reason) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
        "invalid_parameter",
    )


def test_events_to_proto():
    lp = TokenLogprob(7, "hi", -0.5, b"hi", (TopLogprob(7, "hi", -0.5, b"hi"),))
    msg = event_to_proto(ContentDelta(1, "hi", (7,), (lp,)))
    assert msg.content.choice_index == 1 and msg.content.text == "hi" and list(msg.content.token_ids) == [7]
    assert msg.content.logprobs[0].top_logprobs[0].bytes == b"hi"
    fin = event_to_proto(Finished(0, FinishReason.LENGTH, 5)).finished
    assert fin.reason == pb.LENGTH and not fin.HasField("matched_stop_token_id")
    assert event_to_proto(Usage(3, 4)).usage.total_tokens == 7


def test_bad_words_become_the_token_forms_of_each_word():
    vocab = {"cat": [7], " cat": [9], "big dog": [3, 4], " big dog": [5, 4]}
    got = sampling_options(
        pb.SamplingParams(bad_words=["cat", " big dog"]),
        prompt_tokens=10,
        context_length=100,
        vocab_size=1000,
        encode=lambda text: vocab[text],
    )
    # As written (leading spaces dropped) and after one space; duplicates once.
    assert got.bad_words == ((7,), (9,), (3, 4), (5, 4))


def test_bad_words_that_ban_every_allowed_token_are_refused():
    params = pb.SamplingParams(bad_words=["cat"], allowed_token_ids=[7, 9])
    encode = {"cat": [7], " cat": [9]}.__getitem__
    call = lambda: sampling_options(params, prompt_tokens=1, context_length=9, vocab_size=99, encode=encode)  # noqa: E731
    assert param_of(call) == "bad_words"


def test_the_other_extensions_are_carried():
    got = options(allowed_token_ids=[9, 3, 9], skip_special_tokens=False, include_stop_str_in_output=True)
    assert got.allowed_token_ids == (3, 9)
    assert got.skip_special_tokens is False and got.include_stop_str_in_output is True
    assert options().skip_special_tokens is None and options().include_stop_str_in_output is False
    assert options(speculative=False).speculative is False
    assert options(speculative=True).speculative is True and options().speculative is True


@pytest.mark.parametrize(
    ("fields", "kept"),
    [
        ({}, (1, 2, 3, 4, 5)),
        ({"truncate_prompt_tokens": 2}, (4, 5)),
        ({"truncate_prompt_tokens": 9}, (1, 2, 3, 4, 5)),
        # -1: as many as leave room for max_tokens (else one token) in the context of 6.
        ({"truncate_prompt_tokens": -1}, (1, 2, 3, 4, 5)),
        ({"truncate_prompt_tokens": -1, "max_tokens": 3}, (3, 4, 5)),
    ],
)
def test_truncate_prompt_tokens_keeps_the_last_ones(fields, kept):
    assert truncated_prompt(pb.SamplingParams(**fields), (1, 2, 3, 4, 5), context_length=6) == kept


@pytest.mark.parametrize("value", [0, -2, -(2**31)])
def test_truncate_prompt_tokens_out_of_range_names_the_field(value):
    params = pb.SamplingParams(truncate_prompt_tokens=value)
    assert param_of(lambda: truncated_prompt(params, (1, 2), context_length=6)) == "truncate_prompt_tokens"
