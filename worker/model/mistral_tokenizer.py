"""Mistral's own tokenizer files (``tekken.json``): whichever class transformers picks for them (a
mistral-common backend, which the detokenizer and grammars cannot use, or a converted fast tokenizer),
the worker serves the fast tokenizer and keeps mistral-common's beside it: mistral-common encodes the
chats (worker/prompts/mistral_prompt.py), the reference for Mistral's models."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_ATTRIBUTE = "sluice_mistral_common"


def with_mistral_common(tokenizer: Any, folder: Path | None) -> Any:
    """The tokenizer to serve: for a ``tekken.json`` (in ``folder`` or behind a mistral-common backend)
    a fast tokenizer carrying mistral-common's (:func:`mistral_common_of`); else ``tokenizer``."""
    backend = type(tokenizer).__name__ == "MistralCommonBackend"
    path = Path(tokenizer._tokenizer_path) if backend else (folder or Path("-")) / "tekken.json"
    if path.name != "tekken.json" or not path.is_file():
        if backend:
            log.info("mistral-common sentencepiece tokenizer %s: served as transformers loaded it", path.name)
        return tokenizer
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers.integrations.mistral import convert_tekken_tokenizer

    mistral = tokenizer.tokenizer if backend else MistralTokenizer.from_file(str(path))
    served = convert_tekken_tokenizer(str(path), chat_template="") if backend else tokenizer
    served.chat_template = None
    setattr(served, _ATTRIBUTE, mistral)
    version = mistral.instruct_tokenizer.tokenizer.version.value
    log.info("%s (mistral-common %s): chat prompts encoded by mistral-common", path, version)
    return served


def mistral_common_of(tokenizer: Any) -> Any | None:
    """The mistral-common tokenizer (``MistralTokenizer``) that renders this tokenizer's chats, if any."""
    return getattr(tokenizer, _ATTRIBUTE, None)
