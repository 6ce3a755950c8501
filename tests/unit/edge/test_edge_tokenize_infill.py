"""The tokenizer routes' and ``/infill``'s request parsing, and llama.cpp's answer, without processes
(tests/e2e/test_tokenize_e2e.py and tests/integration/test_families_e2e.py run them for real)."""

from __future__ import annotations

from typing import Any

import pytest
from edge_fakes import content, finished, started, usage

from edge.errors import InvalidRequestError
from edge.surfaces.completions.infill import InfillTranslator, parse_infill_request
from edge.surfaces.completions.translate import to_generate_requests
from edge.surfaces.tokenize.request import parse_detokenize_request, parse_tokenize_request
from sluice.v1 import worker_pb2

USER = [{"role": "user", "content": "Hi"}]


def test_tokenize_takes_a_prompt_or_a_chat_as_the_worker_request() -> None:
    text = parse_tokenize_request({"prompt": "Hello", "return_token_strs": True}, "r")
    assert text.prompt.text == "Hello" and text.return_token_strs
    assert not text.HasField("add_special_tokens") and not text.HasField("add_generation_prompt")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = parse_tokenize_request(
        {"messages": USER, "tools": [tool], "tool_choice": "required", "add_generation_prompt": False}, "r"
    )
    assert [m.content for m in chat.chat.messages] == ["Hi"] and chat.chat.tools[0].name == "f"
    assert chat.chat.tool_choice.mode == worker_pb2.ToolChoice.REQUIRED
    assert chat.add_generation_prompt is False
    assert (
        parse_tokenize_request({"prompt": "x", "add_special_tokens": False}, "r").add_special_tokens is False
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "messages": USER}, "prompt"),
        ({}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ],
)
def test_bad_tokenize_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        parse_tokenize_request(body, "r")
    assert raised.value.param == param


def test_detokenize_checks_each_id() -> None:
    assert list(parse_detokenize_request({"tokens": [1, 2]}).ids) == [1, 2]
    for body, param in (({"tokens": [1, -2]}, "tokens[1]"), ({"tokens": []}, "tokens"), ({}, "tokens")):
        with pytest.raises(InvalidRequestError) as raised:
            parse_detokenize_request(body)
        assert raised.value.param == param


def test_infill_becomes_a_completion_with_a_suffix() -> None:
    completion = parse_infill_request(
        {
            "input_prefix": "def f():\n",
            "input_suffix": "\nf()\n",
            "input_extra": [{"filename": "a.py", "text": "X = 1"}],
            "prompt": "    return",
            "n_predict": -1,
            "seed": -1,
            "temperature": 0.2,
            "cache_prompt": True,  # llama.cpp's, ignored
        }
    )
    assert completion.prompt == ["X = 1\ndef f():\n    return"] and completion.suffix == "\nf()\n"
    assert completion.max_tokens is None and completion.seed is None and completion.temperature == 0.2
    (request,) = to_generate_requests(completion, "r")
    assert request.prompt.suffix == "\nf()\n" and not request.sampling.HasField("max_tokens")
    for body, param in (
        ({"n_predict": 0}, "n_predict"),
        ({"n_predict": -2}, "n_predict"),
        ({"stop": [1]}, "stop[0]"),
        ({"top_k": -2}, "top_k"),
        ({"repeat_penalty": 1.1, "repetition_penalty": 1.1}, "repeat_penalty"),
    ):
        with pytest.raises(InvalidRequestError) as raised:
            parse_infill_request(body)
        assert raised.value.param == param, body


def test_infill_takes_the_sampling_extensions() -> None:
    """llama.cpp's plugins send top_k, min_p and repeat_penalty: each reaches the worker."""
    completion = parse_infill_request(
        {"input_prefix": "a", "input_suffix": "b", "top_k": 1, "min_p": 0.05, "repeat_penalty": 1.2}
    )
    (request,) = to_generate_requests(completion, "r")
    assert request.sampling.top_k == 1 and request.sampling.repetition_penalty == pytest.approx(1.2)
    assert request.sampling.min_p == pytest.approx(0.05)


def test_infill_answers_in_llama_cpps_shape() -> None:
    events = [
        started(),
        content("    return 1"),
        content("\n"),
        finished(reason=worker_pb2.LENGTH, tokens=3),
        usage(prompt=9, completion=3),
    ]
    whole = InfillTranslator("m")
    for event in events:
        whole.add(0, event)
    result = whole.result()
    assert result["content"] == "    return 1\n" and result["stop"] is True and result["stop_type"] == "limit"
    assert (result["tokens_predicted"], result["tokens_evaluated"]) == (3, 9)
    streamed = InfillTranslator("m")
    chunks = [chunk for event in events for chunk in streamed.on_event(0, event)] + streamed.finish()
    assert [c["content"] for c in chunks] == ["    return 1", "\n", ""]
    assert [c["stop"] for c in chunks] == [False, False, True] and chunks[-1]["tokens_predicted"] == 3
    word = worker_pb2.GenerateResponse(
        finished=worker_pb2.Finished(reason=worker_pb2.STOP, matched_stop="\n\n")
    )
    stopped = InfillTranslator("m")
    stopped.add(0, word)
    assert (stopped.result()["stop_type"], stopped.result()["stopping_word"]) == ("word", "\n\n")
