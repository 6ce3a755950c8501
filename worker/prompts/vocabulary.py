"""Looking up tokens by their text without copying the vocabulary: a fast tokenizer's own index
answers each lookup, where ``get_vocab()`` builds a dict of the whole vocabulary (hundreds of
milliseconds for 150k-262k tokens) for a few membership tests."""

from __future__ import annotations

from typing import Any, Protocol


class TokenLookup(Protocol):
    """What finding a few marker tokens needs of a vocabulary (a dict or a :class:`TokenIndex`)."""

    def __contains__(self, token: object) -> bool: ...

    def __getitem__(self, token: str) -> int: ...


class TokenIndex:
    """``token in index`` and ``index[token]`` for one tokenizer, added tokens included (as
    ``get_vocab()`` has them); tokenizers without a fast backend answer from their vocabulary."""

    def __init__(self, tokenizer: Any):
        backend = getattr(tokenizer, "_tokenizer", None)
        self._lookup = getattr(backend, "token_to_id", None)
        self._vocab: dict[str, int] = {}
        if self._lookup is None and hasattr(tokenizer, "get_vocab"):
            self._vocab = tokenizer.get_vocab()

    def get(self, token: str) -> int | None:
        """``token``'s id, or None where the vocabulary has no such token."""
        if self._lookup is not None:
            found = self._lookup(token)
            return None if found is None else int(found)
        return self._vocab.get(token)

    def __contains__(self, token: object) -> bool:
        return isinstance(token, str) and self.get(token) is not None

    def __getitem__(self, token: str) -> int:
        found = self.get(token)
        if found is None:
            raise KeyError(token)
        return found
