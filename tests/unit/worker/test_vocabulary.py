"""Token lookups by text (worker/prompts/vocabulary.py) against the tokenizer's own vocabulary."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.tiny_vlms import _fixture
from worker.prompts.vocabulary import TokenIndex


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(_fixture("qwen3"))


def test_every_token_and_added_token_has_its_vocabulary_id(tokenizer: Any) -> None:
    vocab = tokenizer.get_vocab()
    index = TokenIndex(tokenizer)
    assert "<think>" in vocab and all(index[token] == i for token, i in vocab.items())


def test_an_absent_token_is_not_found(tokenizer: Any) -> None:
    index = TokenIndex(tokenizer)
    assert "<no such marker>" not in index and index.get("<no such marker>") is None and 7 not in index
    with pytest.raises(KeyError):
        index["<no such marker>"]


def test_a_tokenizer_without_a_fast_backend_answers_from_its_vocabulary() -> None:
    class Slow:
        def get_vocab(self) -> dict[str, int]:
            return {"<fim_prefix>": 3}

    index = TokenIndex(Slow())
    assert index["<fim_prefix>"] == 3 and "<fim_suffix>" not in index
