"""The OpenAI (legacy) text completions request, validated.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, StrictInt, field_validator

from edge.requests.limits import RequestLimits, active_limits
from edge.requests.validation import bad, invalid, text_or_tokens_shapes, validate_body
from edge.surfaces.shared.sampling import SamplingRequest, check_sampling_limits
from edge.surfaces.shared.structured import StructuredRequest
from sluice.limits import INT32_MAX, MAX_N

# One worker call is opened per prompt; this bounds the fan-out of one request.
MAX_PROMPTS = 128
# OpenAI's limit for the legacy integer ``logprobs``.
MAX_LEGACY_LOGPROBS = 5

Prompt = str | list[int]
# The accepted prompt shapes as the OpenAPI document shows them (the validator below checks them).
_PromptShapes = text_or_tokens_shapes(MAX_PROMPTS)


class CompletionRequest(SamplingRequest, StructuredRequest):
    """A validated ``POST /v1/completions`` body (docs/edge-internals.md, "Completions request")."""

    ignored_fields = frozenset({"service_tier", "prompt_cache_key", "safety_identifier"})

    prompt: list[Prompt]
    # OpenAI's default is 16; an explicit null means "up to the context length".
    # 0 with ``echo``: the prompt is only scored (its logprobs), as evaluation harnesses ask.
    max_tokens: int | None = Field(default=16, ge=0, le=INT32_MAX)
    echo: StrictBool = False
    # Strict: ``true`` (the chat API's boolean) is a mistake here, not 1.
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LEGACY_LOGPROBS)
    # Only ``best_of == n`` is served, so it has ``n``'s bounds.
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    # Fill-in-the-middle: the worker lays the prompt out with the model's FIM tokens, or refuses
    # (400 naming ``suffix``) a model that has none.
    suffix: str | None = Field(
        default=None,
        description="The text after the completion (fill-in-the-middle), for a model with FIM tokens.",
    )

    @field_validator("prompt", mode="before", json_schema_input_type=_PromptShapes)
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        return normalize_prompt(value)


def normalize_prompt(value: Any) -> list[Prompt]:
    """The accepted ``prompt`` shapes as a list of prompts; raises a validation error otherwise."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise invalid("must be a string, a list of strings, a list of token ids or a list of such lists")
    if all(isinstance(item, str) for item in value):
        prompts: list[Prompt] = list(value)
    elif all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        prompts = [_token_ids(value, "prompt")]
    elif all(isinstance(item, list) for item in value):
        prompts = [_token_ids(item, f"prompt[{i}]") for i, item in enumerate(value)]
    else:
        raise invalid("a list prompt must hold only strings, only token ids, or only lists of token ids")
    if len(prompts) > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    return prompts


def _token_ids(value: list[Any], where: str) -> list[int]:
    if not value:
        raise invalid(f"{where} is an empty list of token ids")
    for position, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT32_MAX:
            raise invalid(f"{where}[{position}] is not a token id (an integer >= 0)")
    return list(value)


def parse_completion_request(body: Any, limits: RequestLimits | None = None) -> CompletionRequest:
    """Validates a decoded JSON body fully, ``limits`` (default:
    :func:`~edge.surfaces.shared.chat_request.active_limits`) included; raises :class:`InvalidRequestError`
    (or :class:`~edge.errors.UnprocessableEntityError` for a non-object body)."""
    request = validate_body(CompletionRequest, body)
    if request.suffix and request.echo:
        raise bad("suffix", "cannot be combined with echo")
    n = request.choices_per_prompt
    if request.best_of is not None and request.best_of != n:
        reason = (
            f"best_of ({request.best_of}) must be at least n ({n})"
            if request.best_of < n
            else f"best_of greater than n ({request.best_of} > {n}) is not supported; "
            "ask for n choices instead"
        )
        raise bad("best_of", reason)
    if request.max_tokens == 0 and not request.echo:
        raise bad("max_tokens", "must be at least 1, or 0 together with echo (to score the prompt only)")
    request.structured_form()
    check_completion_limits(request, limits or active_limits())
    return request


def check_completion_limits(request: CompletionRequest, limits: RequestLimits) -> None:
    """Raises a 400 naming the field when ``request`` is over one of ``limits``."""
    size = sum(len(prompt) for prompt in request.prompt)
    if size > limits.max_prompt_chars:
        raise bad(
            "prompt",
            f"the prompts hold {size} characters (or token ids); at most {limits.max_prompt_chars} "
            "are accepted",
        )
    check_sampling_limits(request, limits)
    if request.logprobs is not None and request.logprobs > limits.max_top_logprobs:
        raise bad("logprobs", f"must be at most {limits.max_top_logprobs}, got {request.logprobs}")
