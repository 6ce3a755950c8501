"""The operator's per-request limits (``--max-messages`` and friends), which every surface's parser
applies; each may only lower the contract's own (:mod:`sluice.limits`)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from sluice.limits import MAX_N, MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds an operator tunes (``--max-messages`` and friends, see docs/http.md).

    ``max_prompt_chars`` counts the characters of every message's text
    (``content``, ``reasoning_content``, tool-call ``arguments``) of a chat
    request, or of every prompt of a completions request (a token-id prompt
    counts one per id). ``max_images`` bounds the image parts of one request, ``max_image_bytes``
    each image's decoded size; ``allow_image_urls`` lets ``http(s)`` image URLs through to the
    fetch (else they are a 400). ``max_tokens`` bounds ``max_tokens`` and
    ``max_completion_tokens`` when a request sets them; 0 means no bound at
    the edge (the worker still bounds them by the context length). ``n`` is
    per prompt. ``__post_init__`` raises ``ValueError`` naming a bad field.
    """

    max_messages: int = 1024
    max_prompt_chars: int = 1_000_000
    max_n: int = MAX_N
    max_tokens: int = 0
    max_top_logprobs: int = MAX_TOP_LOGPROBS
    max_images: int = 8
    max_image_bytes: int = 4 * 1024 * 1024
    allow_image_urls: bool = False

    def __post_init__(self) -> None:
        for name, low, high in (
            ("max_messages", 1, None),
            ("max_prompt_chars", 1, None),
            ("max_n", 1, MAX_N),
            ("max_tokens", 0, None),
            ("max_top_logprobs", 0, MAX_TOP_LOGPROBS),
            ("max_images", 0, None),
            ("max_image_bytes", 1, None),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
            if high is not None and value > high:
                raise ValueError(f"{name}: must be at most {high}, got {value}")


DEFAULT_LIMITS = RequestLimits()
# The limits of the request being parsed; the edge app sets it per request (None: the defaults).
request_limits: ContextVar[RequestLimits | None] = ContextVar("sluice_request_limits", default=None)


def active_limits() -> RequestLimits:
    """The limits set for this context, else :data:`DEFAULT_LIMITS`."""
    return request_limits.get() or DEFAULT_LIMITS
