"""Property-based tests of the gRPC API: hypothesis builds ``GenerateRequest`` messages from every
field's full range (int32 and uint64 extremes, NaN and infinite floats, empty and huge strings,
token ids beyond the vocabulary, unknown enum values, invalid and deep JSON, wrong roles) and raw
bytes that are not a valid message (invalid UTF-8 in a string field, truncated messages), and
sends them to a real worker process (``--fake-tokens``: the real tokenizer, chat template,
validation and grammar compiler, no model).

Every call must end with a status that docs/grpc.md documents for a caller's request: OK,
INVALID_ARGUMENT (whose details name the field), NOT_FOUND (another model) or RESOURCE_EXHAUSTED;
never INTERNAL, UNKNOWN or a hang (the deadline is generous, so DEADLINE_EXCEEDED fails too).
Afterwards a normal request still succeeds and no sequence is left running.
``SLUICE_FUZZ_SCALE`` multiplies the example counts (``make fuzz``).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.status import read_details
from sluice.v1 import worker_pb2 as pb
from tests.fuzz.http_checks import MODEL, examples
from tests.processes import WorkerProcess

pytestmark = pytest.mark.integration

VOCAB = 49152  # the default model's vocabulary
INT32 = (-(2**31), 2**31 - 1)
CALL_DEADLINE_S = 60.0
FAKE_DEFAULT_MAX_TOKENS = 8
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
HUGE = "x" * 300_000

# ------------------------------------------------------------------ strategies


def mostly(valid: st.SearchStrategy[Any], anything: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` three times in four, so that many requests get through to generation."""
    return st.integers(0, 3).flatmap(lambda pick: valid if pick else anything)


int32s = st.one_of(
    st.sampled_from([INT32[0], -1, 0, 1, 2, 16, 17, 20, 21, VOCAB - 1, VOCAB, INT32[1]]),
    st.integers(*INT32),
)
uint64s = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
floats = st.one_of(
    st.sampled_from([0.0, 1.0, 2.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 3.4e38]),
    st.floats(width=32),
)
token_ids = st.one_of(st.integers(0, VOCAB - 1), int32s)
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\x00", "<tool_call>", "</think>", "{{ raise }}", "\ufffd", HUGE]),
)
SCHEMAS = [
    "",
    "{}",
    '{"type": "object"}',
    "not json",
    "[1, 2]",
    "null",
    '{"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "integer"}}}',
    '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}',
    '{"$ref": "#"}',
    '{"type": "frog"}',
    '{"type": "string", "pattern": "("}',
    '{"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}',
    '{"a": ' * 70 + "1" + "}" * 70,
    '{"a": ' * 5000 + "1" + "}" * 5000,
    '{"type": "number", "minimum": NaN}',
    json.dumps({"anyOf": [{"type": "string"}] * 200}),
]
schemas = st.sampled_from(SCHEMAS)
# The caller-written grammar forms: valid, invalid, untranslatable, empty and deep (random text too).
GRAMMARS = {
    "regex": ["[a-z]{1,3}", "[a-z+(", "(?=a)b", "", "a{1000}{1000}", "[^\\x00-\\x{10FFFF}]", "(" * 300],
    "lark": ['start: "a" | "b"', "start: nope", 'start: %json {"type": "integer"}', "", "root ::= [0-9]"],
    "gbnf": ['root ::= "a" [0-9]', 'root ::= <[5]> "x"', "root ::= missing", "start ::= x", "", "root ::= ("],
    "structural_tag_json": [
        json.dumps(
            {
                "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
                "triggers": ["<f>"],
            }
        ),
        json.dumps({"structures": [], "triggers": []}),
        '{"structures": [{"begin": "x"}], "triggers": ["y"]}',
        '{"a": ' * 5000 + "1" + "}" * 5000,
        "nope",
    ],
}
TEMPLATE_KWARGS = [
    "",
    "{}",
    '{"enable_thinking": false}',
    '{"tokenize": true}',
    '{"messages": 1}',
    "[]",
    "nope",
    '{"add_generation_prompt": "x"}',
    '{"a": ' * 500 + "1" + "}" * 500,
]


@st.composite
def messages(draw: st.DrawFn) -> pb.ChatMessage:
    message = pb.ChatMessage(
        role=draw(
            mostly(
                st.just("user"), st.sampled_from(["system", "developer", "assistant", "tool", "", "robot"])
            )
        ),
        tool_call_id=draw(st.sampled_from(["", "call_1"])),
        name=draw(st.sampled_from(["", "bob", HUGE[:1000]])),
    )
    if draw(mostly(st.just(True), st.booleans())):
        message.content = draw(mostly(st.text(min_size=1, max_size=20), texts))
    if draw(st.integers(0, 3)) == 0:
        message.reasoning_content = draw(texts)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        message.tool_calls.add(
            id="c", name=draw(texts), arguments=draw(st.sampled_from(["{}", "", "{", "[]"]))
        )
    return message


@st.composite
def chat_inputs(draw: st.DrawFn) -> pb.ChatInput:
    chat = pb.ChatInput(
        messages=draw(mostly(st.lists(messages(), min_size=1, max_size=3), st.lists(messages(), max_size=4))),
        parallel_tool_calls=draw(st.booleans()),
        chat_template_kwargs_json=draw(mostly(st.just(""), st.sampled_from(TEMPLATE_KWARGS))),
    )
    for _ in range(draw(st.sampled_from([0, 0, 1, 2, 3]))):
        chat.tools.add(
            name=draw(st.one_of(st.sampled_from(["f", "g", ""]), texts)),
            description=draw(texts),
            parameters_json=draw(schemas),
            strict=draw(st.booleans()),
        )
    choice = draw(st.integers(0, 2))
    if choice == 1:
        chat.tool_choice.mode = draw(st.one_of(st.integers(0, 3), int32s))
    elif choice == 2:
        chat.tool_choice.function_name = draw(st.sampled_from(["f", "g", "", "missing"]))
    if draw(st.booleans()):
        chat.enable_thinking = draw(st.booleans())
    return chat


@st.composite
def sampling(draw: st.DrawFn) -> pb.SamplingParams:
    params = pb.SamplingParams(
        stop=draw(mostly(st.just([]), st.lists(texts, max_size=3))),
        stop_token_ids=draw(mostly(st.just([]), st.lists(token_ids, max_size=3))),
        ignore_eos=draw(st.booleans()),
        bad_words=draw(mostly(st.just([]), st.lists(texts, max_size=3))),
        allowed_token_ids=draw(mostly(st.just([]), st.lists(token_ids, max_size=3))),
        include_stop_str_in_output=draw(st.booleans()),
    )
    if draw(st.booleans()):
        params.skip_special_tokens = draw(st.booleans())
    for name, valid_float in (
        ("temperature", st.floats(0.0, 2.0)),
        ("top_p", st.floats(0.05, 1.0)),
        ("min_p", st.floats(0.0, 0.5)),
        ("presence_penalty", st.floats(-2.0, 2.0)),
        ("frequency_penalty", st.floats(-2.0, 2.0)),
        ("repetition_penalty", st.floats(0.5, 2.0)),
    ):
        if draw(st.integers(0, 2)) == 0:
            setattr(params, name, draw(mostly(valid_float, floats)))
    for name, valid_int in (
        ("top_k", st.integers(-1, 50)),
        ("max_tokens", st.integers(1, 6)),
        ("min_tokens", st.integers(0, 2)),
        ("n", st.integers(1, 3)),
        ("logprobs", st.integers(0, 5)),
        # A --fake-tokens worker refuses to score a prompt (INVALID_ARGUMENT naming the field); the
        # real model's scoring is tested in tests/e2e.
        ("prompt_logprobs", st.integers(0, 5)),
        ("truncate_prompt_tokens", st.integers(-1, 8)),
    ):
        if draw(st.integers(0, 2)) == 0:
            setattr(params, name, draw(mostly(valid_int, int32s)))
    if draw(st.booleans()):
        params.seed = draw(uint64s)
    bias = mostly(st.just({}), st.dictionaries(token_ids, mostly(st.floats(-100, 100), floats), max_size=3))
    for token, value in draw(bias).items():
        params.logit_bias[token] = value
    return params


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=draw(st.sampled_from(["", "fuzz", HUGE[:5000], "id with spaces\n"])),
        model=draw(mostly(st.sampled_from(["", MODEL]), st.sampled_from(["other-model", HUGE[:1000]]))),
        sampling=draw(sampling()),
        stream_progress=draw(st.booleans()),
        return_token_ids=draw(st.booleans()),
        echo_prompt=draw(st.booleans()),
        user=draw(texts),
        metadata=draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)),
    )
    kind = draw(mostly(st.sampled_from(["chat", "text"]), st.sampled_from(["ids", "none"])))
    if kind == "chat":
        request.chat.CopyFrom(draw(chat_inputs()))
    elif kind == "text":
        request.prompt.text = draw(mostly(st.text(min_size=1, max_size=30), texts))
    elif kind == "ids":
        request.prompt.token_ids.ids.extend(
            draw(
                mostly(
                    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                    st.lists(token_ids, max_size=6),
                )
            )
        )
    format_kind = draw(
        mostly(st.just("none"), st.sampled_from(["text", "json_object", "json_schema", "choice", *GRAMMARS]))
    )
    if format_kind == "text":
        request.response_format.text = True
    elif format_kind == "json_object":
        request.response_format.json_object = True
    elif format_kind == "json_schema":
        request.response_format.json_schema.schema_json = draw(schemas)
    elif format_kind == "choice":
        request.response_format.choice.choices.extend(draw(st.lists(st.text(max_size=8), max_size=3)))
    elif format_kind in GRAMMARS:
        text = draw(mostly(st.sampled_from(GRAMMARS[format_kind]), st.text(max_size=30)))
        setattr(request.response_format, format_kind, text)
    return request


def _string_field(number: int, data: bytes) -> bytes:
    return bytes([number << 3 | 2]) + _varint(len(data)) + data


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


# Raw messages: invalid UTF-8 in string fields (model; a message's content), truncations, noise.
raw_messages = st.one_of(
    st.binary(max_size=64),
    st.binary(min_size=1, max_size=8).map(lambda junk: _string_field(2, b"\xff" + junk)),
    st.just(_string_field(3, _string_field(1, _string_field(2, b"\xc3(")))),
    st.just(_string_field(4, _string_field(1, b"\xed\xa0\x80"))),  # an encoded surrogate
    st.just(b"\x0a\xff\xff"),
)

# ------------------------------------------------------------------ the worker


@pytest.fixture(scope="module")
def fuzz_worker(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    with WorkerProcess(
        cache_dir=model_cache,
        log_dir=tmp_path_factory.mktemp("grpc-fuzz-worker"),
        extra=[
            "--fake-tokens",
            "--max-running",
            "16",
            "--default-max-tokens",
            str(FAKE_DEFAULT_MAX_TOKENS),
        ],
    ) as worker:
        yield worker


@pytest.fixture(scope="module")
def channel(fuzz_worker: WorkerProcess) -> Iterator[grpc.Channel]:
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(fuzz_worker.address, options=options) as chan:
        yield chan


@pytest.fixture(scope="module")
def statuses() -> Iterator[Counter[str]]:
    counts: Counter[str] = Counter()
    started = time.monotonic()
    yield counts
    print(
        f"\ngRPC fuzzing: {sum(counts.values())} calls in {time.monotonic() - started:.1f} s: {dict(counts)}"
    )


def outcome(call: Any) -> tuple[grpc.StatusCode, str | None, str]:
    """Runs a server-streaming call to its end: (status, details' param, message)."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as error:
        details = read_details(error)
        return details.code, details.param, details.message
    return grpc.StatusCode.OK, None, ""


def check(code: grpc.StatusCode, param: str | None, message: str, what: Any) -> None:
    assert code in ALLOWED, f"{code.name}: {message[:300]} for {str(what)[:1500]}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert param, f"INVALID_ARGUMENT without a field: {message}"


def test_generated_requests_end_with_a_documented_status(
    channel: grpc.Channel, fuzz_worker: WorkerProcess, statuses: Counter[str]
) -> None:
    generate = channel.unary_stream(
        "/sluice.v1.Worker/Generate",
        request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateResponse.FromString,
    )

    @settings(
        max_examples=examples(250), deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(request=generate_requests())
    def one(request: pb.GenerateRequest) -> None:
        code, param, message = outcome(generate(request, timeout=CALL_DEADLINE_S))
        statuses[code.name] += 1
        check(code, param, message, request)

    one()
    still_serves(channel, fuzz_worker)


def test_undecodable_bytes_end_with_a_documented_status(
    channel: grpc.Channel, fuzz_worker: WorkerProcess, statuses: Counter[str]
) -> None:
    generate = channel.unary_stream(
        "/sluice.v1.Worker/Generate",
        request_serializer=lambda data: data,
        response_deserializer=pb.GenerateResponse.FromString,
    )

    @settings(
        max_examples=examples(40), deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(raw=raw_messages)
    def one(raw: bytes) -> None:
        code, param, message = outcome(generate(raw, timeout=CALL_DEADLINE_S))
        statuses[f"raw {code.name}"] += 1
        check(code, param, message, raw)

    one()
    code, param, _ = outcome(generate(_string_field(2, b"\xff\xfe"), timeout=CALL_DEADLINE_S))
    assert (code, param) == (grpc.StatusCode.INVALID_ARGUMENT, "request")
    still_serves(channel, fuzz_worker)


def still_serves(channel: grpc.Channel, worker: WorkerProcess) -> None:
    """A normal request succeeds, and nothing is left running once it ended."""
    generate = channel.unary_stream(
        "/sluice.v1.Worker/Generate",
        request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    request = pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Hello")]),
        sampling=pb.SamplingParams(max_tokens=4),
    )
    events = list(generate(request, timeout=CALL_DEADLINE_S))
    assert events[0].WhichOneof("event") == "started" and events[-1].WhichOneof("event") == "usage"
    deadline = time.monotonic() + 10
    while worker.metrics().get("sluice_worker_running_sequences", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker.metrics().get("sluice_worker_running_sequences", 0) == 0
