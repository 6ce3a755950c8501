"""Issue 24's bar per family (Qwen3, Llama 3.1, Gemma 3, gpt-oss, Mistral with a tekken.json) and
issue 42's for the models of 2026 (Gemma 4's text model; the Qwen3.5, Qwen3-Next and Granite 4
hybrids, over the state pool), through a real worker and edge: a tiny random model saved with the
family's real tokenizer (the closest one the registries offer) and chat template scores its prompt
and decodes greedily like transformers' eager float32 model, and a forced tool call parses (streamed
and not) and the conversation goes on with the tool's result."""

from __future__ import annotations

import functools
import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tests.processes import EdgeProcess, WorkerProcess
from tests.tiny_families import tiny_config, tiny_model
from tools.fixtures import DEFAULT_DIR, build_tekken, fetch_tokenizer

pytestmark = pytest.mark.integration

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
# family -> (tiny_families key, tokenizer fixture, vendored template or None for the tokenizer's own)
FAMILIES = {
    "qwen3": ("qwen3", "qwen3", None),
    "llama3.1": ("llama", "llama3_1", "meta-llama-Llama-3.1-8B-Instruct"),
    "gemma3": ("gemma3_text", "gemma3", None),
    # Its own template; no Gemma 4 tokenizer is on the registries: Gemma 3's (the same vocabulary's).
    "gemma4": ("gemma4_text", "gemma3", "google-gemma-4-31B-it"),
    "gpt-oss": ("gpt_oss", "gptoss", "openai-gpt-oss-120b"),
    "mistral-tekken": ("mistral", "tekken v13", None),  # only a tekken.json, as Mistral ships it
    # Issue 42's hybrids (recurrent layers beside attention layers, over the state pool): Qwen3.5 and
    # Qwen3-Next (Gated DeltaNet) with Qwen3's tokenizer and Qwen3.5's template, Granite 4 (Mamba-2)
    # with Llama 3.1's tokenizer and its own template.
    "qwen3_5": ("qwen3_5_text", "qwen3", "Qwen3.5-4B"),
    "qwen3_next": ("qwen3_next", "qwen3", "Qwen3.5-4B"),
    "granite4": ("granitemoehybrid", "llama3_1", "ibm-granite-granite-4.0"),
}
# Tiny widths: the real vocabularies (128k-262k) make the embedding the model's bulk.
TINY = {
    "hidden_size": 32,
    "intermediate_size": 32,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris? Answer briefly."}]
GREEDY_TOKENS = 24
# Room for a forced call's first call: after it a random model goes on with more calls until the
# limit (Gemma 4 and Mistral do), each token masked by the grammar over a 131k-262k vocabulary.
CALL_TOKENS = 48
# family -> (tool-call parser, reasoning parser) that /v1/models shows
FORMATS = {
    "qwen3": ("hermes", "qwen3"),
    "llama3.1": ("llama3_json", None),
    "gemma3": ("hermes", None),
    "gemma4": ("gemma4", "gemma4"),
    "gpt-oss": ("openai", "openai_gptoss"),
    "mistral-tekken": ("mistral", "mistral"),
    "qwen3_5": ("qwen3_coder", "qwen3"),
    "qwen3_next": ("qwen3_coder", "qwen3"),
    "granite4": ("hermes", None),
}


@dataclass
class EagerRun:
    """The eager reference on the chat prompt: each prompt token's logprob after the one before,
    and the greedy tokens after the prompt (``GREEDY_TOKENS``, EOS suppressed)."""

    prompt_logprobs: torch.Tensor
    greedy: list[int]


@dataclass
class Served:
    family: str
    edge: EdgeProcess
    tokenizer: Any
    reference: Any
    model: str
    eager: EagerRun | None = None


@functools.cache
def loaded_tokenizer(fixture: str) -> tuple[Any, str | None]:
    """A tokenizer fixture loaded once per module and its own chat template: families sharing a
    tokenizer (Qwen3's, Llama 3.1's, Gemma 3's) each set their template on it in turn (a module
    fixture serves one family at a time), instead of reading the large vocabulary again."""
    from transformers import AutoTokenizer

    from worker.model.mistral_tokenizer import with_mistral_common

    if fixture.startswith("tekken"):
        tekken = build_tekken(DEFAULT_DIR, fixture.split()[1])
        tokenizer = with_mistral_common(AutoTokenizer.from_pretrained(tekken), tekken)
    else:
        tokenizer = AutoTokenizer.from_pretrained(fetch_tokenizer(fixture, DEFAULT_DIR))
    return tokenizer, tokenizer.chat_template


def build(folder: Path, family: str) -> tuple[Any, Any]:
    """Saves the family's tiny model with its real tokenizer and template; returns the tokenizer and
    transformers' eager float32 reference of the same weights: the saved model itself, switched to
    eager attention once saved (nothing else here runs it; the same logits, bit for bit, as a
    second model built by ``eager_reference`` and loaded with its weights, without that build)."""
    key, fixture, template = FAMILIES[family]
    tokenizer, own_template = loaded_tokenizer(fixture)
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text() if template else own_template
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    # Gemma 4's per-layer embeddings have a vocabulary of their own.
    per_layer = {"vocab_size_per_layer_input": len(tokenizer)} if key == "gemma4_text" else {}
    # Granite 4's Mamba heads must fill twice TINY's hidden size.
    narrower = {"mamba_d_head": 8} if key == "granitemoehybrid" else {}
    config = tiny_config(key, vocab_size=len(tokenizer), **TINY, **ids, **per_layer, **narrower)
    model = tiny_model(config)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    if fixture.startswith("tekken"):
        shutil.copy(build_tekken(DEFAULT_DIR, fixture.split()[1]) / "tekken.json", folder / "tekken.json")
    else:
        tokenizer.save_pretrained(folder)
    model.set_attn_implementation("eager")
    return tokenizer, model


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    family = request.param
    folder = tmp_path_factory.mktemp(f"tiny-{family}")
    tokenizer, reference = build(folder, family)
    logs = tmp_path_factory.mktemp(f"logs-{family}")
    extra = ["--quantization", "none", "--kv-cache-bytes", str(64 << 20)]
    with (
        WorkerProcess(cache_dir=folder / "cache", log_dir=logs, model=str(folder), extra=extra) as worker,
        EdgeProcess([worker.address], log_dir=logs) as edge,
    ):
        model = httpx.get(f"{edge.base_url}/v1/models").json()["data"][0]["id"]
        yield Served(family, edge, tokenizer, reference, model)


def test_models_list_shows_the_chosen_chat_formats(served: Served) -> None:
    entry = httpx.get(f"{served.edge.base_url}/v1/models").json()["data"][0]
    formats = entry["chat_formats"]
    assert (formats["tool_call_parser"], formats["reasoning_parser"]) == FORMATS[served.family]
    assert formats["thinking_switch"]


def prompt_ids(served: Served) -> list[int]:
    from worker.model.mistral_tokenizer import mistral_common_of

    mistral = mistral_common_of(served.tokenizer)
    if mistral is not None:  # the reference for a tekken tokenizer: mistral-common's encoding
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        request = ChatCompletionRequest.from_openai(QUESTION, tools=[WEATHER])
        return list(mistral.encode_chat_completion(request).tokens)
    rendered = served.tokenizer.apply_chat_template(
        QUESTION, tools=[WEATHER], add_generation_prompt=True, return_dict=True
    )
    return list(rendered["input_ids"])


def complete(served: Served, **body: Any) -> dict[str, Any]:
    response = httpx.post(
        f"{served.edge.base_url}/v1/completions", json={"model": served.model, **body}, timeout=120
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


class NoEos(LogitsProcessor):
    """Masks the reference's EOS ids at every step, as ``min_new_tokens`` does up to the count the
    reference generates (the worker's ``ignore_eos``), without its two per-step scans of the
    whole 128k-262k vocabulary."""

    def __init__(self, eos: int | list[int] | None) -> None:
        self.eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores[:, self.eos] = -math.inf
        return scores


def greedy_reference(served: Served, ids: list[int], count: int, past: Any = None) -> list[int]:
    """The reference's ``count`` greedy tokens after ``ids`` (EOS masked), going on from ``past``
    (a cache of all of ``ids`` but the last) where given."""
    with torch.no_grad():
        out = served.reference.generate(
            torch.tensor([ids]),
            **({} if past is None else {"cache": past}),
            max_new_tokens=count,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            logits_processor=LogitsProcessorList([NoEos(served.reference.generation_config.eos_token_id)]),
        )
    return list(out[0, len(ids) :].tolist())


def eager_run(served: Served, ids: list[int]) -> EagerRun:
    """The reference's :class:`EagerRun` on ``ids``, computed once per family: one forward over
    the prompt but its last token gives the prompt logprobs and the cache ``generate`` goes on
    from (the same greedy tokens as a ``generate`` from scratch, without a second prefill)."""
    if served.eager is None:
        with torch.no_grad():
            scored = served.reference(torch.tensor([ids[:-1]]), use_cache=True)
        logprobs = torch.log_softmax(scored.logits[0].float(), dim=-1)
        expected = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        greedy = greedy_reference(served, ids, GREEDY_TOKENS, scored.past_key_values)
        served.eager = EagerRun(expected, greedy)
    return served.eager


def test_prompt_logprobs_equal_transformers_eager(served: Served) -> None:
    ids = prompt_ids(served)
    answer = complete(served, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    got = answer["choices"][0]["logprobs"]["token_logprobs"]
    expected = eager_run(served, ids).prompt_logprobs
    assert got[0] is None and len(got) == len(ids)
    assert torch.allclose(torch.tensor(got[1:]), expected, atol=5e-3, rtol=0)


def test_greedy_tokens_equal_transformers_generate(served: Served) -> None:
    ids = prompt_ids(served)
    answer = complete(served, prompt=ids, max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
    generated = eager_run(served, ids).greedy
    assert len(generated) == GREEDY_TOKENS
    assert answer["usage"]["completion_tokens"] == GREEDY_TOKENS
    assert answer["choices"][0]["text"] == served.tokenizer.decode(generated, skip_special_tokens=True)


def forced_call(served: Served, stream: bool) -> tuple[str, str, str]:
    """(id, name, arguments) of the first call of a ``tool_choice: "required"`` answer."""
    client = openai.OpenAI(base_url=f"{served.edge.base_url}/v1", api_key="unused", timeout=120)
    kwargs: dict[str, Any] = {"model": served.model, "messages": QUESTION, "tools": [WEATHER]}
    kwargs |= {"tool_choice": "required", "max_tokens": CALL_TOKENS, "temperature": 0}
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.tool_calls, message
        call = message.tool_calls[0]
        return call.id, call.function.name, call.function.arguments
    parts: dict[str, str] = {"id": "", "name": "", "arguments": ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.index != 0:  # parallel calls are allowed: the first is checked
                continue
            parts["id"] += delta.id or ""
            if delta.function is not None:
                parts["name"] += delta.function.name or ""
                parts["arguments"] += delta.function.arguments or ""
    return parts["id"], parts["name"], parts["arguments"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice_gives_a_parseable_call_and_the_conversation_goes_on(
    served: Served, stream: bool
) -> None:
    call_id, name, arguments = forced_call(served, stream)
    assert name == "get_weather" and call_id
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature_c": 18}'},
    ]
    body = {"model": served.model, "messages": messages, "tools": [WEATHER], "max_tokens": 4}
    response = httpx.post(f"{served.edge.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_tokenize_counts_the_prompt_a_chat_generation_reports(served: Served) -> None:
    """``/tokenize`` renders a chat (the family's own tool format) exactly as a generation does."""
    chat = {"model": served.model, "messages": QUESTION, "tools": [WEATHER]}
    tokenized = httpx.post(f"{served.edge.base_url}/tokenize", json=chat, timeout=120).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 20
    response = httpx.post(
        f"{served.edge.base_url}/v1/chat/completions", json={**chat, "max_tokens": 1}, timeout=120
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == tokenized["count"]


def test_suffix_fills_in_the_middle_where_the_vocabulary_has_fim_tokens(served: Served) -> None:
    """Qwen3's vocabulary (the Qwen3.5 model's here too) has ``<|fim_prefix|>`` and friends,
    Mistral's tekken ``[PREFIX]`` and ``[SUFFIX]`` (Codestral's suffix-first layout): the prompt is
    laid out with them (the greedy middle equals the eager model's from that layout), also through
    llama.cpp's ``/infill``, streamed or not. The other families' vocabularies have none: a 400
    naming the field."""
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    body = {"prompt": prefix, "suffix": suffix, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    base = served.edge.base_url
    tok = served.tokenizer
    if served.family in ("qwen3", "qwen3_5", "qwen3_next"):  # the same vocabulary
        layout = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
        ids = tok(layout, add_special_tokens=False)["input_ids"]
    elif served.family == "mistral-tekken":
        marker = tok.convert_tokens_to_ids
        ids = [
            *tok("", add_special_tokens=True)["input_ids"],
            marker("[SUFFIX]"),
            *tok(suffix, add_special_tokens=False)["input_ids"],
            marker("[PREFIX]"),
            *tok(prefix, add_special_tokens=False)["input_ids"],
        ]
    else:
        refused = httpx.post(f"{base}/v1/completions", json={"model": served.model, **body}, timeout=120)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "suffix", refused.text
        return
    answer = complete(served, **body)
    assert answer["usage"]["prompt_tokens"] == len(ids)
    middle = answer["choices"][0]["text"]
    assert middle == served.tokenizer.decode(greedy_reference(served, ids, 4), skip_special_tokens=True)

    infill = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 4, "temperature": 0}
    whole = httpx.post(f"{base}/infill", json=infill, timeout=120)
    assert whole.status_code == 200, whole.text
    result = whole.json()
    assert result["stop"] is True and result["tokens_evaluated"] == len(ids)
    assert middle.startswith(result["content"])  # the same greedy middle (it may end at EOS)
    events = []
    with httpx.stream("POST", f"{base}/infill", json={**infill, "stream": True}, timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    assert events[-1]["stop"] is True and all(event["stop"] is False for event in events[:-1])
    assert "".join(event["content"] for event in events) == result["content"]


def test_a_repeated_prompt_reports_cached_tokens_and_gives_the_same_text(served: Served) -> None:
    """A second request with the same (chat) prompt reuses its cached prefix (a hybrid model's up to
    its state checkpoint at the prompt's last block boundary) and answers as the first did."""
    ids = prompt_ids(served)
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    first, again = complete(served, **body), complete(served, **body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids) // 2
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    want = first["choices"][0]["logprobs"]["token_logprobs"]
    assert again["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want, abs=5e-3)


def test_a_zero_thinking_budget_leaves_no_reasoning_and_the_answer_follows(served: Served) -> None:
    """``thinking_token_budget: 0`` (issue 46): where the template opens the thinking block itself
    (Qwen3.5's, Qwen3-Next's here), the worker closes it with the family's own marker before any
    thinking, and the random model's tokens are the answer; elsewhere the field changes nothing."""
    body = {"model": served.model, "messages": QUESTION, "max_tokens": 8, "temperature": 0}
    body |= {"ignore_eos": True, "thinking_token_budget": 0}
    response = httpx.post(f"{served.edge.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    message = answer["choices"][0]["message"]
    assert not message.get("reasoning_content") and message["content"]
    # At most the forced end marker is counted as thinking.
    assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] <= 1
