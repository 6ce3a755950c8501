"""Incremental detokenization that never splits a character.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context so the first generated token gets the
# spacing it would have inside the full text.
CONTEXT_TOKENS = 4


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class _BackendDecoder:
    """A transformers fast tokenizer's own Rust decoder, called directly: what its ``decode`` returns
    for a list of ids when it cleans up no spaces, without the per-call Python around it (about a
    third of a streamed token's output processing)."""

    def __init__(self, backend: Any):
        self._backend = backend

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens))


class ByteLevelDecoder(_BackendDecoder):
    """A byte-level BPE tokenizer's decoder, whose text of a run of tokens is the UTF-8 of their
    bytes joined: :class:`IncrementalDetokenizer` streams with those bytes, calling no decode
    while the text is whole characters. An added token's bytes are its content's, kept only
    where decoding it alone gives that text (else the detokenizer decodes around it); a special
    token skipped has none."""

    def __init__(self, backend: Any):
        super().__init__(backend)
        self._added = backend.get_added_tokens_decoder()
        self._bytes: dict[bool, dict[int, bytes | None]] = {False: {}, True: {}}

    def token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes | None:
        """The bytes ``token_id`` decodes to with ``skip_special_tokens`` (None: unknown here)."""
        cache = self._bytes[skip_special_tokens]
        found = cache.get(token_id, _UNKNOWN)
        if found is _UNKNOWN:
            found = cache[token_id] = self._lookup(token_id, skip_special_tokens)
        return found  # type: ignore[return-value]

    def _lookup(self, token_id: int, skip: bool) -> bytes | None:
        added = self._added.get(token_id)
        if added is not None and added.special and skip:
            return b"" if self.decode([token_id], skip_special_tokens=True) == "" else None
        piece = added.content if added is not None else self._backend.id_to_token(token_id)
        if not piece:
            return None
        if all(ch in _BYTE_DECODER for ch in piece):
            raw = bytes(_BYTE_DECODER[ch] for ch in piece)
        else:  # the decoder keeps such a piece's own text
            raw = piece.encode()
        if added is not None and self.decode([token_id]) != raw.decode(errors="replace"):
            return None  # an added token this tokenizer decodes otherwise: left to decode
        return raw


_UNKNOWN = object()


def fast_decoder(tokenizer: Any) -> Decoder:
    """``tokenizer``, or its Rust decoder where calling that is the same: a transformers fast
    tokenizer whose ``decode`` and ``_decode`` are the library's own and that cleans up no spaces
    (tests/unit/worker/test_detokenizer.py holds it to ``decode`` on every family's tokenizer)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the tokenizer as it is
        return cast(Decoder, tokenizer)
    kind = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
        and not _cleans_up_spaces(tokenizer)
    ):
        backend = tokenizer._tokenizer
        byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        return ByteLevelDecoder(backend) if byte_level else _BackendDecoder(backend)
    return cast(Decoder, tokenizer)


def _cleans_up_spaces(tokenizer: Any) -> bool:
    """Whether ``decode`` cleans up spaces: asked, and (the library skips it for BPE) not BPE
    unless forced."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
    )
    return type(tokenizer._tokenizer.model).__name__ != "BPE" or bool(forced)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas. One instance per sequence.

    Each delta is the decode of the tokens from the last delta's start on, less the decode of
    those before the new ones (their left context), once it ends in a whole character. With a
    :class:`ByteLevelDecoder` the common case calls no decode: the new tokens' bytes, once they
    are whole UTF-8, are that delta exactly (the context being whole characters too).
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._bytes_of = tokenizer if isinstance(tokenizer, ByteLevelDecoder) else None
        # The new tokens' bytes when the bytes path applies (the context is whole characters of
        # known bytes, so are the tokens since); None: decode.
        self._pending: bytes | None = self._context_bytes()

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text that is now complete ("" when waiting)."""
        self._ids.append(token_id)
        if self._pending is not None and self._bytes_of is not None:
            piece = self._bytes_of.token_bytes(token_id, self._skip)
            if piece is not None:
                pending = self._pending + piece
                try:
                    text = pending.decode()
                except UnicodeDecodeError as error:
                    if error.reason == "unexpected end of data":  # a character not yet complete
                        self._pending = pending
                        return ""
                else:
                    if not text:
                        return ""
                    if text[-1] != REPLACEMENT:
                        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                        self._pending = b""
                        return text
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._pending = self._context_bytes()
            return full[len(prefix) :]
        self._pending = None
        return ""

    def flush(self) -> str:
        """Returns whatever is still held back (at the end of a sequence)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        self._pending = None
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _context_bytes(self) -> bytes | None:
        """b"" when the bytes path applies from here: the context (the tokens from
        ``prefix_offset``, none pending) has known bytes that are whole UTF-8 characters."""
        if self._bytes_of is None:
            return None
        pieces = []
        for token_id in self._ids[self._prefix_offset :]:
            piece = self._bytes_of.token_bytes(token_id, self._skip)
            if piece is None:
                return None
            pieces.append(piece)
        try:
            b"".join(pieces).decode()
        except UnicodeDecodeError:
            return None
        return b""

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


_BYTE_DECODER = _byte_decoder()


class TokenTexts:
    """Text and exact bytes of single tokens, for logprobs (cached per id).

    Byte-level BPE tokens map back to their raw bytes (which may be part of a
    character); SentencePiece byte-fallback tokens (``<0xE2>``) to their byte;
    anything else to the UTF-8 of its decoded text.
    """

    def __init__(self, tokenizer: Decoder):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)  # type: ignore[attr-defined]
        raw: bytes | None = None
        if isinstance(piece, str):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                raw = bytes([int(piece[3:5], 16)])
            elif piece and all(ch in _BYTE_DECODER for ch in piece):
                raw = bytes(_BYTE_DECODER[ch] for ch in piece)
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if raw is None:
            raw = text.encode("utf-8")
        return text, raw
