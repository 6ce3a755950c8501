"""Fill-in-the-middle and the Tokenize options of the prompt renderer, through real tokenizers: the
Qwen3 fixture (tools/fixtures.py) has FIM tokens, Llama 3.1's has none."""

from __future__ import annotations

from typing import Any

import pytest

from tools.fixtures import DEFAULT_DIR, fetch_tokenizer
from worker.errors import InvalidRequest
from worker.prompts.fim import FimTokens, find_fim_tokens
from worker.prompts.prompt import ChatMessage, ChatPrompt, PromptRenderer, RawPrompt

_TOKENIZERS: dict[str, Any] = {}


def real_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = AutoTokenizer.from_pretrained(fetch_tokenizer(name, DEFAULT_DIR))
    return _TOKENIZERS[name]


def test_the_families_fim_tokens_are_found_in_the_vocabulary() -> None:
    qwen = find_fim_tokens(real_tokenizer("qwen3").get_vocab())
    assert qwen == FimTokens("qwen", 151659, 151661, 151660)
    deepseek = {
        "<\uff5cfim\u2581begin\uff5c>": 5,
        "<\uff5cfim\u2581hole\uff5c>": 6,
        "<\uff5cfim\u2581end\uff5c>": 7,
    }
    assert find_fim_tokens(deepseek) == FimTokens("deepseek", 5, 6, 7)
    assert find_fim_tokens(real_tokenizer("llama3_1").get_vocab()) is None
    starcoder = {"<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3, "x": 4}
    assert find_fim_tokens(starcoder) == FimTokens("starcoder", 1, 3, 2)
    codestral = find_fim_tokens({"[PREFIX]": 7, "[SUFFIX]": 8})
    assert codestral == FimTokens("codestral", 7, 8, None, suffix_first=True)


def test_layouts_put_prefix_suffix_and_middle_in_the_familys_order() -> None:
    assert FimTokens("qwen", 1, 2, 3).layout([10, 11], [20]) == [1, 10, 11, 2, 20, 3]
    assert FimTokens("codestral", 7, 8, None, suffix_first=True).layout([10], [20, 21]) == [8, 20, 21, 7, 10]


def test_a_suffix_is_laid_out_with_the_qwen3_fim_tokens() -> None:
    tokenizer = real_tokenizer("qwen3")
    renderer = PromptRenderer(tokenizer)
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    ids, text = renderer.render(RawPrompt(text=prefix, suffix=suffix))
    assert text == f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert list(ids) == expected
    # Token-id prefixes too; an empty prefix is a gap at the start.
    prefix_ids = tuple(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    assert renderer.render(RawPrompt(token_ids=prefix_ids, suffix=suffix))[0] == ids
    assert (
        renderer.render(RawPrompt(text="", suffix=suffix))[1]
        == f"<|fim_prefix|><|fim_suffix|>{suffix}<|fim_middle|>"
    )


def test_a_model_without_fim_tokens_refuses_a_suffix_naming_it() -> None:
    renderer = PromptRenderer(real_tokenizer("llama3_1"))
    assert renderer.fim is None
    with pytest.raises(InvalidRequest) as raised:
        renderer.render(RawPrompt(text="def f(", suffix="return 1"))
    assert raised.value.param == "suffix" and "fill-in-the-middle" in raised.value.message


def test_tokenize_options_change_only_what_they_name() -> None:
    tokenizer = real_tokenizer("llama3_1")  # adds BOS to raw text
    renderer = PromptRenderer(tokenizer)
    plain = renderer.render(RawPrompt(text="Hello there"))[0]
    bare = renderer.render(RawPrompt(text="Hello there"), add_special_tokens=False)[0]
    assert plain == (tokenizer.bos_token_id, *bare)
    qwen = PromptRenderer(real_tokenizer("qwen3"))
    chat = ChatPrompt(messages=(ChatMessage("user", "Hi"),))
    with_prompt, text = qwen.render(chat)
    without, short_text = qwen.render(chat, add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\n") and not short_text.endswith("assistant\n")
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)
    assert qwen.decode(with_prompt) == text
    assert qwen.token_strings((151659,)) == ["<|fim_prefix|>"]
    with pytest.raises(InvalidRequest) as raised:
        qwen.decode((len(real_tokenizer("qwen3")) + 5,))
    assert raised.value.param == "tokens"
