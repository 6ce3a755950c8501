"""vLLM's sampling options end to end (issue 26): the openai SDK's ``extra_body`` on chat and
completions against a real edge and worker (default model), the worker's handling of each option
over gRPC, and ``--strict-fields``.

Each check compares the model with itself (greedy text with and without an option), never with
what the model happens to write.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from sluice.status import read_details
from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Describe the city of Paris in two sentences."}]
PROMPT = "The city of Paris is famous for"
TOKENS = 10


@pytest.fixture(scope="module")
def strict_edge(
    default_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EdgeProcess]:
    """A second edge, started with ``--strict-fields``, in front of the same worker."""
    log_dir = tmp_path_factory.mktemp("strict-edge-log")
    with EdgeProcess([default_worker.address], log_dir=log_dir, extra=["--strict-fields"]) as edge:
        yield edge


def sdk(edge: EdgeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(default_edge: EdgeProcess) -> openai.OpenAI:
    return sdk(default_edge)


@pytest.fixture(scope="module")
def stub(default_worker: WorkerProcess) -> Iterator[pb_grpc.WorkerStub]:
    with grpc.insecure_channel(default_worker.address) as channel:
        yield pb_grpc.WorkerStub(channel)


def chat_text(client: openai.OpenAI, temperature: float, **extra: Any) -> str:
    answer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=temperature, max_tokens=TOKENS, extra_body=extra or None
    )
    return answer.choices[0].message.content or ""


def completion_text(client: openai.OpenAI, temperature: float, **extra: Any) -> str:
    answer = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=temperature, max_tokens=TOKENS, extra_body=extra or None
    )
    return answer.choices[0].text


TEXTS = {"chat": chat_text, "completions": completion_text}


@pytest.fixture(scope="module")
def greedy(client: openai.OpenAI) -> dict[str, str]:
    """Each surface's greedy (temperature 0) text, asked once."""
    return {surface: text(client, 0) for surface, text in TEXTS.items()}


@pytest.mark.parametrize("surface", TEXTS)
def test_top_k_one_at_temperature_one_is_the_greedy_text(
    client: openai.OpenAI, greedy: dict[str, str], surface: str
) -> None:
    assert greedy[surface]
    # One candidate per step: the likeliest, whatever the temperature.
    assert TEXTS[surface](client, 1.0, top_k=1, seed=7) == greedy[surface]


def a_word(text: str) -> str:
    """The first word of at least four letters in ``text``."""
    words = re.findall(r"[A-Za-z]{4,}", text)
    assert words, text
    return words[0]


@pytest.mark.parametrize("surface", TEXTS)
def test_bad_words_keep_a_word_out(client: openai.OpenAI, greedy: dict[str, str], surface: str) -> None:
    word = a_word(greedy[surface])
    without = TEXTS[surface](client, 0, bad_words=[word])
    assert without != greedy[surface]
    assert not re.search(rf"\b{word}\b", without), (word, without)


def test_stop_strings_can_be_kept_and_bad_values_are_refused(
    client: openai.OpenAI, greedy: dict[str, str]
) -> None:
    text = greedy["completions"]
    stop = a_word(text)
    cut = text[: text.index(stop)]
    assert completion_text(client, 0, stop=[stop], include_stop_str_in_output=True) == cut + stop
    # Out of range: a 400 naming the field, never dropped.
    with pytest.raises(openai.BadRequestError) as caught:
        chat_text(client, 0, top_k=-2)
    assert caught.value.body["param"] == "top_k"  # type: ignore[index]


def test_strict_fields_refuse_an_unknown_field_by_name(
    client: openai.OpenAI, strict_edge: EdgeProcess, greedy: dict[str, str]
) -> None:
    strict = sdk(strict_edge)
    with pytest.raises(openai.BadRequestError) as caught:
        chat_text(strict, 0, topk=1)
    error = caught.value.body
    assert error["param"] == "topk" and error["code"] == "unknown_parameter"  # type: ignore[index]
    assert "topk" in error["message"]  # type: ignore[index]
    # Without the setting the same field is ignored; with it, the known extensions still pass.
    assert chat_text(client, 0, topk=1) == greedy["chat"]
    assert chat_text(strict, 0, top_k=1, store=False) == greedy["chat"]


# ------------------------------------------------------------ the worker, over gRPC


def generate(
    stub: pb_grpc.WorkerStub, prompt: str | list[int], **sampling: Any
) -> tuple[pb.Started, str, list[int]]:
    """A greedy raw-prompt call: (started, text, token ids)."""
    prompt_input = (
        pb.PromptInput(token_ids=pb.TokenIds(ids=prompt))
        if isinstance(prompt, list)
        else pb.PromptInput(text=prompt)
    )
    params = pb.SamplingParams(**{"temperature": 0, "max_tokens": TOKENS, **sampling})
    events = list(
        stub.Generate(pb.GenerateRequest(prompt=prompt_input, sampling=params, return_token_ids=True))
    )
    started = events[0].started
    text = "".join(e.content.text for e in events if e.HasField("content"))
    ids = [t for e in events if e.HasField("content") for t in e.content.token_ids]
    return started, text, ids


@pytest.fixture(scope="module")
def raw_greedy(stub: pb_grpc.WorkerStub) -> tuple[pb.Started, str, list[int]]:
    return generate(stub, PROMPT)


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_bad_words_ban_every_token_form_of_the_word(
    stub: pb_grpc.WorkerStub, tokenizer: Any, raw_greedy: tuple[pb.Started, str, list[int]]
) -> None:
    _, greedy, ids = raw_greedy
    word = a_word(greedy)
    forms = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    assert any(contains(ids, form) for form in forms)
    _, text, banned = generate(stub, PROMPT, bad_words=[word])
    assert not any(contains(banned, form) for form in forms), (word, text)


def test_allowed_token_ids_are_all_that_is_generated(stub: pb_grpc.WorkerStub, tokenizer: Any) -> None:
    allowed = sorted({tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " maybe")})
    _, _, ids = generate(stub, PROMPT, allowed_token_ids=allowed, max_tokens=6, ignore_eos=True)
    assert len(ids) == 6 and set(ids) <= set(allowed)


def test_skip_special_tokens_decides_whether_special_tokens_are_text(
    stub: pb_grpc.WorkerStub, tokenizer: Any
) -> None:
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = {"allowed_token_ids": [special], "max_tokens": 2, "ignore_eos": True}
    assert generate(stub, PROMPT, **forced)[1] == ""  # the default: special tokens are not text
    assert generate(stub, PROMPT, **forced, skip_special_tokens=False)[1] == "<|im_start|>" * 2


def test_include_stop_str_in_output_keeps_the_matched_stop(
    stub: pb_grpc.WorkerStub, raw_greedy: tuple[pb.Started, str, list[int]]
) -> None:
    _, greedy, _ = raw_greedy
    stop = a_word(greedy)
    cut = greedy[: greedy.index(stop)]
    assert generate(stub, PROMPT, stop=[stop])[1] == cut
    assert generate(stub, PROMPT, stop=[stop], include_stop_str_in_output=True)[1] == cut + stop


def test_include_stop_str_in_output_keeps_a_stop_token_s_text(
    stub: pb_grpc.WorkerStub, tokenizer: Any, raw_greedy: tuple[pb.Started, str, list[int]]
) -> None:
    _, greedy, ids = raw_greedy
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # its first appearance
    cut = generate(stub, PROMPT, stop_token_ids=[ids[at]])[1]
    assert cut == tokenizer.decode(ids[:at])  # the stop token is not text by default
    kept = generate(stub, PROMPT, stop_token_ids=[ids[at]], include_stop_str_in_output=True)[1]
    assert kept == tokenizer.decode(ids[: at + 1]) and greedy.startswith(kept)


def test_truncate_prompt_tokens_keeps_the_last_tokens(stub: pb_grpc.WorkerStub, tokenizer: Any) -> None:
    ids = tokenizer(PROMPT)["input_ids"]  # as the worker tokenizes a raw prompt
    started, text, _ = generate(stub, PROMPT, truncate_prompt_tokens=3)
    assert started.prompt_tokens == 3
    assert text == generate(stub, ids[-3:])[1]  # the same as sending only those tokens
    assert len(ids) > 3


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"top_k": -5}, "top_k"),
    ],
)
def test_out_of_range_options_are_invalid_argument_naming_the_field(
    stub: pb_grpc.WorkerStub, sampling: dict[str, Any], param: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, PROMPT, **sampling)
    details = read_details(info.value)
    assert details.code == grpc.StatusCode.INVALID_ARGUMENT and details.param == param
