import random

import pytest
from transformers import AutoTokenizer

from tests.unit.worker.test_fim import real_tokenizer
from tools.fixtures import TOKENIZERS
from worker.output.detokenizer import ByteLevelDecoder, IncrementalDetokenizer, TokenTexts, fast_decoder

pytestmark = pytest.mark.slow  # left out of make test-fast

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


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
def test_the_fast_decoder_decodes_as_the_tokenizer_does(family):
    """Each family's real tokenizer (tools/fixtures.py): its Rust decoder, called directly, gives
    what ``decode`` gives, special tokens kept or skipped; streamed text is unchanged."""
    tokenizer = real_tokenizer(family)
    decoder = fast_decoder(tokenizer)
    assert decoder is not tokenizer  # every family's tokenizer takes the direct path
    rng = random.Random(family)
    special = sorted(tokenizer.all_special_ids)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )
    for text in SAMPLES:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        fast, plain = IncrementalDetokenizer(decoder, []), IncrementalDetokenizer(tokenizer, [])
        assert [fast.push(i) for i in ids] == [plain.push(i) for i in ids]


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tokenizer):
    """transformers skips the clean-up for BPE unless forced: only a forced clean-up (or a
    WordPiece tokenizer's) keeps ``decode``."""
    forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    assert fast_decoder(tokenizer) is not tokenizer
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert fast_decoder(tokenizer) is not tokenizer
        setattr(tokenizer, forced, True)
        assert fast_decoder(tokenizer) is tokenizer
    finally:
        tokenizer.clean_up_tokenization_spaces = False
        setattr(tokenizer, forced, False)


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
def test_the_byte_level_path_streams_what_decoding_streams(family):
    """A byte-level tokenizer's detokenizer streams from token bytes: every push and flush gives
    what the decode path gives, on random ids with added and special tokens, lone bytes and whole
    texts, special tokens kept or skipped; and ordinary text calls no decode once started."""
    tokenizer = real_tokenizer(family)
    decoder = fast_decoder(tokenizer)
    if not isinstance(decoder, ByteLevelDecoder):
        pytest.skip(f"{family}'s decoder is not byte-level")
    calls = []

    class Counted(ByteLevelDecoder):
        def decode(self, token_ids, skip_special_tokens=False):
            calls.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    counted = Counted(tokenizer._tokenizer)
    rng = random.Random(family)
    added = sorted(tokenizer._tokenizer.get_added_tokens_decoder())
    lone_bytes = [
        i for i in range(len(tokenizer)) if tokenizer.convert_ids_to_tokens(i) in ("â", "Ģ", "ð", "Ł")
    ]
    prompt = tokenizer("Hi there", add_special_tokens=False)["input_ids"]
    for _ in range(40):
        ids = tokenizer(rng.choice(SAMPLES), add_special_tokens=False)["input_ids"]
        for _ in range(rng.randrange(4)):
            ids.insert(
                rng.randrange(len(ids) + 1), rng.choice(added + lone_bytes + [rng.randrange(len(tokenizer))])
            )
        for skip in (True, False):
            fast = IncrementalDetokenizer(counted, prompt, skip)
            plain = IncrementalDetokenizer(tokenizer, prompt, skip)
            assert [fast.push(i) for i in ids] == [plain.push(i) for i in ids]
            assert fast.flush() == plain.flush()
    calls.clear()
    text = IncrementalDetokenizer(counted, prompt)
    streamed = "".join(text.push(i) for i in tokenizer(SAMPLES[1], add_special_tokens=False)["input_ids"])
    assert streamed == SAMPLES[1] and calls == []
