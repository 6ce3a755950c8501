"""The sampling fields chat and text completions requests share, and their limits."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, StrictBool, field_validator

from edge.requests.limits import RequestLimits
from edge.requests.models import RequestModel
from edge.requests.validation import bad, in_range, invalid
from sluice.limits import (
    INT32_MAX,
    LOGIT_BIAS,
    MAX_BAD_WORDS,
    MAX_N,
    MIN_P,
    PENALTY,
    REPETITION_PENALTY,
    TEMPERATURE,
    TOP_P,
)

# Seeds: any int64 (OpenAI) or uint64 (the proto) value.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class StreamOptions(RequestModel):
    """``stream_options``; only allowed with ``stream: true``."""

    include_usage: StrictBool = Field(
        default=False, description="End the stream with one chunk carrying the total usage (choices: [])."
    )
    continuous_usage_stats: StrictBool = Field(
        default=False,
        description="vLLM's extension: every chunk carries the usage so far (completion tokens counted "
        "per choice and summed).",
    )


_TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


def _not_blank(word: str) -> str:
    if not word.strip():
        raise invalid("a bad word may not be empty or only spaces")
    return word


_Word = Annotated[str, AfterValidator(_not_blank), Field(json_schema_extra={"pattern": r"\S"})]


class SamplingExtensions(RequestModel):
    """vLLM's sampling extensions with vLLM's names, meanings and bounds (the openai SDK sends them
    through ``extra_body``); every surface that samples takes them from here (docs/http.md)."""

    top_k: int | None = Field(
        default=None, ge=-1, le=INT32_MAX, description="Sample from the k likeliest tokens; -1 or 0: off."
    )
    min_p: float | None = in_range(
        MIN_P, description="Drop tokens less likely than min_p times the likeliest."
    )
    repetition_penalty: float | None = in_range(
        REPETITION_PENALTY,
        description="Divide positive (multiply negative) logits of prompt and output tokens; 1: off.",
    )
    stop_token_ids: list[_TokenId] | None = Field(
        default=None, description="Token ids that end the choice (not shown in the text)."
    )
    bad_words: list[_Word] | None = Field(
        default=None,
        max_length=MAX_BAD_WORDS,
        description="Words never generated, as written and after a space.",
    )
    allowed_token_ids: list[_TokenId] | None = Field(
        default=None, min_length=1, description="Only these token ids may be generated."
    )
    skip_special_tokens: StrictBool | None = Field(
        default=None, description="Leave special tokens out of the text (default: the model family's)."
    )
    include_stop_str_in_output: StrictBool | None = Field(
        default=None, description="Keep the matched stop string at the end of the text."
    )
    truncate_prompt_tokens: int | None = Field(
        default=None,
        ge=-1,
        le=INT32_MAX,
        description="Keep only the prompt's last k tokens; -1: as many as the context leaves room for.",
        json_schema_extra={"not": {"const": 0}},
    )
    speculative: StrictBool | None = Field(
        default=None,
        description="false: no speculative decoding for this request; unset or true: the worker's "
        "--speculative decides (the output is the same either way).",
    )
    # Run past the model's end-of-sequence token, and generate at least this many tokens.
    ignore_eos: StrictBool | None = None
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    priority: int | None = Field(
        default=None,
        ge=-INT32_MAX - 1,
        le=INT32_MAX,
        description="Scheduling priority (vLLM's): lower is served first, default 0; honoured by "
        "workers run with --scheduling-policy priority or fair, within the caller's tenant under fair.",
    )

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise invalid("must be -1 or at least 1, got 0")
        return value

    def given_extensions(self) -> dict[str, Any]:
        """The extensions the caller set, as a chat body carries them (a rewritten surface's)."""
        return self.model_dump(include=set(SamplingExtensions.model_fields), exclude_none=True)


class SamplingRequest(SamplingExtensions):
    """Fields shared by chat and text completions requests."""

    model: str
    temperature: float | None = in_range(TEMPERATURE)
    top_p: float | None = in_range(TOP_P)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stop: list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = in_range(PENALTY)
    frequency_penalty: float | None = in_range(PENALTY)
    logit_bias: dict[str, float] | None = Field(
        default=None,
        json_schema_extra={
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": {"type": "number", "minimum": LOGIT_BIAS.low, "maximum": LOGIT_BIAS.high},
        },
    )
    user: str | None = None

    @field_validator("stop", mode="before", json_schema_input_type=str | list[str] | None)
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()) or not 0 <= int(key) <= INT32_MAX:
                raise invalid(f"key {key!r} is not a token id")
            if bias not in LOGIT_BIAS:
                raise invalid(f"bias {bias} for token {key} is not in {LOGIT_BIAS}")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def choices_per_prompt(self) -> int:
        return self.n if self.n is not None else 1


def check_sampling_limits(request: SamplingRequest, limits: RequestLimits) -> None:
    """The limits on fields both APIs share: ``n`` and ``max_tokens``."""
    if request.n is not None and request.n > limits.max_n:
        raise bad("n", f"must be at most {limits.max_n}, got {request.n}")
    if request.max_tokens is not None and limits.max_tokens:
        check_max_tokens("max_tokens", request.max_tokens, limits)


def check_max_tokens(param: str, value: int, limits: RequestLimits) -> None:
    if value > limits.max_tokens:
        raise bad(param, f"must be at most {limits.max_tokens}, got {value}")
