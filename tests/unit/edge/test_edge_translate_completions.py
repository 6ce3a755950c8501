"""Golden tests of edge.surfaces.completions.translate: prompts → protos, events → text_completion dicts."""

from __future__ import annotations

from typing import Any

from edge_fakes import content, finished, started, usage

from edge.surfaces.completions.request import parse_completion_request
from edge.surfaces.completions.translate import (
    CompletionsTranslator,
    LegacyLogprobs,
    to_generate_requests,
)
from sluice.v1 import worker_pb2


def protos(**fields: Any) -> list[worker_pb2.GenerateRequest]:
    return to_generate_requests(parse_completion_request({"model": "m", **fields}), "req-1")


def test_one_request_per_prompt_with_shared_sampling() -> None:
    text, ids = protos(
        prompt=["Hello", "World"],
        n=2,
        temperature=0,
        stop="\n",
        seed=3,
        logprobs=2,
        user="u",
        max_tokens=5,
        stream=True,
        stream_options={"continuous_usage_stats": True},
    )
    assert text.prompt.text == "Hello" and ids.prompt.text == "World"
    assert (text.request_id, ids.request_id) == ("req-1.0", "req-1.1")
    for proto in (text, ids):
        assert proto.WhichOneof("input") == "prompt" and proto.model == "m" and proto.user == "u"
        s = proto.sampling
        assert (s.n, s.temperature, list(s.stop), s.seed, s.logprobs, s.max_tokens) == (2, 0, ["\n"], 3, 2, 5)
        assert proto.return_token_ids and not proto.echo_prompt


def test_token_prompts_defaults_and_echo() -> None:
    (single,) = protos(prompt=[1, 2, 3])
    assert single.request_id == "req-1"
    assert list(single.prompt.token_ids.ids) == [1, 2, 3]
    assert single.sampling.max_tokens == 16  # OpenAI's default
    assert not single.sampling.HasField("logprobs") and not single.return_token_ids
    first, second = protos(prompt=[[1], [2, 3]], echo=True, max_tokens=None)
    assert list(second.prompt.token_ids.ids) == [2, 3] and first.echo_prompt
    assert not first.sampling.HasField("max_tokens")  # explicit null: up to the context


def token(
    text: str, logprob: float, raw: bytes, top: list[tuple[str, float]] = ()
) -> worker_pb2.TokenLogprob:  # type: ignore[assignment]
    return worker_pb2.TokenLogprob(
        token=text,
        logprob=logprob,
        bytes=raw,
        top_logprobs=[worker_pb2.TopLogprob(token=t, logprob=lp, bytes=t.encode()) for t, lp in top],
    )


def test_legacy_logprobs_offsets_follow_characters_not_bytes() -> None:
    legacy = LegacyLogprobs()
    # "é" is two bytes split over two byte-level tokens; offsets count characters.
    first = legacy.entries(
        [token("A", -0.25, b"A", [("A", -0.25), ("B", -2.0)]), token("\ufffd", -0.5, b"\xc3")]
    )
    second = legacy.entries([token("\ufffd", -0.125, b"\xa9"), token("!", -0.375, b"!", [("?", -1.0)])])
    assert first == {
        "tokens": ["A", "\ufffd"],
        "token_logprobs": [-0.25, -0.5],
        "top_logprobs": [{"A": -0.25, "B": -2.0}, {"\ufffd": -0.5}],
        "text_offset": [0, 1],
    }
    assert second["text_offset"] == [1, 2]  # "é" starts at 1 and completes at the second byte
    # The sampled token is always in top_logprobs (up to logprobs + 1 entries, as OpenAI says).
    assert second["top_logprobs"][1] == {"?": -1.0, "!": -0.375}
    assert LegacyLogprobs(base_offset=10).entries([token("x", 0.0, b"x")])["text_offset"] == [10]


def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 9,
        "model": "M",
        "system_fingerprint": None,
        "choices": choices,
        **extra,
    }


def text_choice(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


def test_two_prompts_two_choices_map_to_four_indexes_with_echo_and_usage() -> None:
    builder = CompletionsTranslator("cmpl-x", 9, "M", n=2, echo=True, include_usage=True)

    def prompt_started(text: str, tokens: int) -> worker_pb2.GenerateResponse:
        return worker_pb2.GenerateResponse(
            started=worker_pb2.Started(model="M", prompt_tokens=tokens, n=2, prompt_text=text)
        )

    events = [
        (1, prompt_started("B?", 2)),
        (0, prompt_started("A?", 3)),
        (1, content("b1", index=1)),
        (0, content("a0", index=0)),
        (0, finished(index=0, tokens=1)),
        (0, finished(index=1, reason=worker_pb2.LENGTH, tokens=1)),
        (0, usage(prompt=3, completion=2)),
        (1, finished(index=1, tokens=1)),
        (1, finished(index=0, tokens=1)),
        (1, usage(prompt=2, completion=2)),
    ]
    chunks = [c for call, event in events for c in builder.on_event(call, event)] + builder.finish()
    assert chunks == [
        chunk([text_choice(2, "B?")], usage=None),
        chunk([text_choice(3, "B?")], usage=None),
        chunk([text_choice(0, "A?")], usage=None),
        chunk([text_choice(1, "A?")], usage=None),
        chunk([text_choice(3, "b1")], usage=None),
        chunk([text_choice(0, "a0")], usage=None),
        chunk([text_choice(0, "", "stop")], usage=None),
        chunk([text_choice(1, "", "length")], usage=None),
        chunk([text_choice(3, "", "stop")], usage=None),
        chunk([text_choice(2, "", "stop")], usage=None),
        chunk(
            [],
            usage={
                "prompt_tokens": 5,
                "completion_tokens": 4,
                "total_tokens": 9,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0},
            },
        ),
    ]


def test_stream_without_usage_options_has_no_usage_key_and_carries_legacy_logprobs() -> None:
    builder = CompletionsTranslator("cmpl-x", 9, "M", logprobs=True)
    delta = worker_pb2.GenerateResponse(
        content=worker_pb2.ContentDelta(text="Hi", logprobs=[token("Hi", -0.5, b"Hi", [("Hi", -0.5)])])
    )
    chunks = [c for e in (started(), delta, finished()) for c in builder.on_event(0, e)] + builder.finish()
    assert chunks == [
        chunk(
            [
                text_choice(
                    0,
                    "Hi",
                    logprobs={
                        "tokens": ["Hi"],
                        "token_logprobs": [-0.5],
                        "top_logprobs": [{"Hi": -0.5}],
                        "text_offset": [0],
                    },
                )
            ]
        ),
        chunk([text_choice(0, "", "stop")]),
    ]


def test_accumulator_joins_echo_text_and_logprobs_per_choice() -> None:
    acc = CompletionsTranslator("cmpl-x", 9, "M", n=1, logprobs=True)
    for call, event in [
        (0, started(prompt_tokens=2)),
        (1, started(prompt_tokens=3)),
        (
            0,
            worker_pb2.GenerateResponse(
                content=worker_pb2.ContentDelta(text="a", logprobs=[token("a", -1, b"a")])
            ),
        ),
        (
            1,
            worker_pb2.GenerateResponse(
                content=worker_pb2.ContentDelta(text="x", logprobs=[token("x", -2, b"x")])
            ),
        ),
        (
            0,
            worker_pb2.GenerateResponse(
                content=worker_pb2.ContentDelta(text="b", logprobs=[token("b", -3, b"b")])
            ),
        ),
        (0, finished(tokens=2)),
        (1, finished(reason=worker_pb2.LENGTH, tokens=1)),
        (0, usage(2, 2)),
        (1, usage(3, 1)),
    ]:
        acc.add(call, event)
    result = acc.result()
    assert result["object"] == "text_completion" and result["id"] == "cmpl-x"
    first, second = result["choices"]
    assert (first["index"], first["text"], first["finish_reason"]) == (0, "ab", "stop")
    assert first["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-1, -3],
        "top_logprobs": [{"a": -1}, {"b": -3}],
        "text_offset": [0, 1],
    }
    assert (second["index"], second["text"], second["finish_reason"]) == (1, "x", "length")
    assert result["usage"]["prompt_tokens"] == 5 and result["usage"]["completion_tokens"] == 3


def test_accumulator_echo_prepends_the_rendered_prompt() -> None:
    acc = CompletionsTranslator("cmpl-x", 9, "M", n=2, echo=True)
    acc.add(0, worker_pb2.GenerateResponse(started=worker_pb2.Started(n=2, prompt_text="Say: ")))
    acc.add(0, content("hi", index=1))
    acc.add(0, finished(index=0))
    acc.add(0, finished(index=1))
    assert [c["text"] for c in acc.result()["choices"]] == ["Say: ", "Say: hi"]
    assert all(c["logprobs"] is None for c in acc.result()["choices"])


def test_echo_with_logprobs_lists_the_prompt_tokens_first_with_a_null_first_logprob() -> None:
    scored = worker_pb2.GenerateResponse(
        prompt_logprobs=worker_pb2.PromptLogprobs(
            first_token="Say",
            first_token_bytes=b"Say",
            first_token_id=7,
            logprobs=[token(":", -0.25, b":"), token(" ", -1.5, b" ")],
        )
    )
    acc = CompletionsTranslator("cmpl-x", 9, "M", n=1, echo=True, logprobs=True)
    acc.add(0, worker_pb2.GenerateResponse(started=worker_pb2.Started(n=1, prompt_text="Say: ")))
    acc.add(0, scored)
    acc.add(
        0,
        worker_pb2.GenerateResponse(
            content=worker_pb2.ContentDelta(text="hi", logprobs=[token("hi", -2, b"hi")])
        ),
    )
    acc.add(0, finished(index=0))
    choice = acc.result()["choices"][0]
    assert choice["text"] == "Say: hi"
    assert choice["logprobs"] == {
        "tokens": ["Say", ":", " ", "hi"],
        "token_logprobs": [None, -0.25, -1.5, -2],
        "top_logprobs": [None, {":": -0.25}, {" ": -1.5}, {"hi": -2}],
        "text_offset": [0, 3, 4, 5],
    }
    builder = CompletionsTranslator("cmpl-x", 9, "M", n=1, echo=True, logprobs=True)
    builder.on_event(0, worker_pb2.GenerateResponse(started=worker_pb2.Started(n=1, prompt_text="Say: ")))
    (chunk_,) = builder.on_event(0, scored)
    assert chunk_["choices"][0]["text"] == "" and chunk_["choices"][0]["logprobs"]["token_logprobs"] == [
        None,
        -0.25,
        -1.5,
    ]
