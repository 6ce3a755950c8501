import random

import pytest
from transformers import AutoTokenizer

from worker.output.detokenizer import IncrementalDetokenizer, TokenTexts

SAMPLES = [
    "Hello, world! How are you today?",
    "Ünïcödé: 日本語のテキスト, emoji 🐉🔥 and ñ.",
    "  leading spaces\n\nnew lines\tand tabs  ",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("text", SAMPLES)
def test_streamed_text_equals_full_decode_and_never_splits_a_character(tokenizer, text):
    prompt = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_emoji_split_over_byte_tokens_waits_for_the_whole_character(tokenizer):
    ids = tokenizer("🐉", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE: the dragon is several byte tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.push(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🐉"


def test_token_bytes_concatenate_to_the_utf8_text(tokenizer):
    texts = TokenTexts(tokenizer)
    for text in SAMPLES:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert b"".join(texts(i)[1] for i in ids) == text.encode()


@pytest.mark.parametrize("seed", range(5))
def test_random_unicode_round_trips(tokenizer, seed):
    rng = random.Random(seed)
    alphabet = "abc xyz éàü 中文字 🙂🚀 \n"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [])
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == tokenizer.decode(ids)
