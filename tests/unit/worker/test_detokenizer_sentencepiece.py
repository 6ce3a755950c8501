"""Incremental detokenization with a SentencePiece-style tokenizer (Metaspace "▁" spaces, byte fallback),
built on the spot with the `tokenizers` library so no model is downloaded."""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from worker.output.detokenizer import IncrementalDetokenizer, TokenTexts

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there, general kenobi",
    "streaming text must keep its spaces right",
    "numbers 123 456 and punctuation !?.,;",
] * 20


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    core.normalizer = normalizers.Replace(" ", "▁")
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    core.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    core.train_from_iterator(CORPUS, trainer)
    # The trainer registers its extra tokens as special; in SentencePiece vocabularies the byte
    # tokens are ordinary ones (skip_special_tokens must keep them).
    data = json.loads(core.to_str())
    for token in data["added_tokens"]:
        token["special"] = token["content"] in ("<unk>", "<s>", "</s>")
    core = Tokenizer.from_str(json.dumps(data))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.mark.parametrize(
    "text", ["hello world", "  two leading spaces", "the fox: ünïcode 日本 🐉 here", "end with space "]
)
def test_spaces_and_characters_survive_streaming(tokenizer, text):
    prompt = tokenizer("general kenobi says", add_special_tokens=False)["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    full = tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas)


def test_byte_fallback_character_is_emitted_whole(tokenizer):
    ids = tokenizer("🐉", add_special_tokens=False)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert sum(p.startswith("<0x") for p in pieces) == 4  # four byte tokens: not in the vocabulary
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) in ("🐉", " 🐉") and all(d == "" for d in deltas[:-1])


def test_byte_fallback_tokens_report_their_single_byte(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer("🐉", add_special_tokens=False)["input_ids"]
    raw = b"".join(texts(i)[1] for i in ids if tokenizer.convert_ids_to_tokens(i).startswith("<0x"))
    assert raw == "🐉".encode()


@pytest.mark.parametrize("seed", range(4))
def test_random_text_round_trips(tokenizer, seed):
    rng = random.Random(seed)
    words = ["hello", "world", "fox", "dog", "ünï", "日本", "🙂", "123", "!", "  "]
    text = " ".join(rng.choice(words) for _ in range(25))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detok.push(i) for i in ids) + detok.flush() == tokenizer.decode(ids)
