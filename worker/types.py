"""Internal request and event types of the worker: no torch, no protobuf.

``service/convert.py`` turns wire messages into these and back; the engine and the
scheduler only ever see these. Events form a closed union (``Event``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingOptions:
    """Validated sampling and stopping options of one request.

    Defaults match OpenAI's: temperature 1, top_p 1, no top_k / min_p, no
    penalties. ``max_tokens`` is always resolved (never None) by the time a
    request reaches the engine.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top alternatives; None = no logprobs
    prompt_logprobs: int | None = None  # the prompt's logprobs with this many alternatives; None = none
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never generated (each word's forms)
    allowed_token_ids: tuple[int, ...] = ()  # only these may be generated; () = every token
    skip_special_tokens: bool | None = None  # None: the family's default
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text
    speculative: bool = True  # False: this request never speculates, whatever --speculative says

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class OutputOptions:
    """How a request's output text is parsed into events."""

    tool_calls: bool = False  # tools were given and tool_choice is not "none"
    reasoning: bool = False  # the model thinks between <think> markers
    keep_reasoning: bool = True  # False: thinking was turned off; drop any that appears
    starts_thinking: bool = False  # the prompt already opened the thinking block
    tool_parser: str = "hermes"  # the family's tool-call format (a worker/formats/ name)
    reasoning_parser: str = "qwen3"  # the family's thinking format
    keep_special_tokens: bool = False  # the formats' markers are special tokens: decode them


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt: its placeholder tokens' span ``[start, end)`` in the prompt, the key
    its placeholder blocks are cached under (from a hash of the image's bytes), and the processor's
    arrays the vision encoder reads (name -> numpy array, this image's alone)."""

    start: int
    end: int
    key: int
    inputs: Mapping[str, Any]
    # M-RoPE models: the image's tokens as a grid (time, rows, columns); empty otherwise.
    grid: tuple[int, ...] = ()
    # The placeholder runs ``[start, end)`` within the span when it holds other tokens too (an
    # Idefics3 image's tiles, each after its own marker); empty: the whole span is placeholders.
    runs: tuple[tuple[int, int], ...] = ()

    def placeholders(self, start: int, end: int) -> int:
        """How many of this image's placeholders lie in positions ``[start, end)``."""
        return sum(max(0, min(end, b) - max(start, a)) for a, b in self.runs or ((self.start, self.end),))


@dataclass(frozen=True, eq=False)
class LoraHandle:
    """A request's LoRA adapter as the engine sees it: ``name`` as served, ``uid`` unique to one
    load of it (the prefix cache's keys and the device slots tell adapters apart by it),
    ``max_active``: ``--max-loras``, the adapters one step may hold; ``weights``: the loaded
    adapter (worker/lora/adapter.py's ``LoraWeights``; opaque below the model layer)."""

    name: str
    uid: int
    max_active: int
    weights: Any = field(repr=False)


@dataclass(frozen=True)
class Scheduling:
    """Where a request stands in the queue (``--scheduling-policy``, docs/worker.md "Scheduling
    policies"): its ``priority`` (lower first), its ``tenant`` (the edge's, from the API key) and its
    ``deadline`` (``time.monotonic()`` when its caller gives up; None: never)."""

    priority: int = 0
    tenant: str = ""
    deadline: float | None = None


@dataclass(frozen=True)
class ThinkingBudget:
    """A cap on each choice's thinking (vLLM's ``thinking_token_budget``): once ``tokens`` tokens were
    written inside the family's block (``open_text`` ... ``close_text``), ``close_ids`` are forced
    and the answer follows. ``starts_thinking``: the prompt opened the block."""

    tokens: int
    open_text: str
    close_text: str
    close_ids: tuple[int, ...]
    starts_thinking: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """A tokenized request, ready for the scheduler."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    arrival_time: float
    return_token_ids: bool = False
    output: OutputOptions = OutputOptions()
    grammar: str | None = None  # an llguidance grammar (worker.sampling.grammar); None = unconstrained
    # Stream migration (``Resume`` on the wire; n == 1 only): the tokens an earlier call already
    # generated and delivered. They are prefilled after the prompt and count as generated: in
    # max_tokens, the context length, penalties, seeded draws, the grammar and usage.
    resumed_token_ids: tuple[int, ...] = ()
    images: tuple[PromptImage, ...] = ()  # a vision-language model's images, in prompt order
    lora: LoraHandle | None = None  # the LoRA adapter the request names; None = the base model
    scheduling: Scheduling = Scheduling()
    thinking_budget: ThinkingBudget | None = None  # None: thinking is not capped
    # Hand the tokens over at most about once per this many seconds (``stream_interval_ms`` on the
    # wire; worker/engine/sink.py ``paced_by_time``); 0: every step, or per ``--stream-interval``.
    stream_interval_s: float = 0.0

    @property
    def prefill_token_ids(self) -> tuple[int, ...]:
        """What the first forward pass computes: the prompt, then any resumed tokens."""
        return (
            self.prompt_token_ids + self.resumed_token_ids
            if self.resumed_token_ids
            else self.prompt_token_ids
        )


@dataclass(frozen=True)
class FastPath:
    """Which parts of the CUDA decode fast path are on (a metric: off means a slower fallback)."""

    kernel: bool  # the Triton decode attention kernel
    graphs: bool  # decode steps replayed from CUDA graphs
    fused: bool = False  # RMSNorm, SiLU·mul and rotary kernels in the forward (worker/model/fused.py)
    quant: bool | None = None  # every int4/fp8 layer on its CUDA kernel (None: no such layer)


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CONTENT_FILTER = "content_filter"


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Timings:
    queue_seconds: float = 0.0
    time_to_first_token_seconds: float = 0.0
    decode_seconds: float = 0.0


# ------------------------------------------------------------------ events


# The per-token records (ContentDelta, NewToken; worker/model/step_inputs.py's Work) are slotted, not
# frozen: a frozen dataclass sets each field through object.__setattr__, 0.6 against 0.13 us per
# object here, and one of each is built per token. Treat them as immutable all the same.
@dataclass(slots=True)
class ContentDelta:
    choice_index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ReasoningDelta:
    choice_index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class RefusalDelta:
    choice_index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    choice_index: int
    tool_index: int
    arguments: str
    call_id: str = ""
    name: str = ""
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """The logprob of every prompt token after the first, in prompt order (asked with prompt_logprobs);
    the first token (which has no logprob) by id, text and bytes."""

    logprobs: tuple[TokenLogprob, ...]
    first_token_id: int = 0
    first_token: str = ""
    first_token_bytes: bytes = b""


@dataclass(frozen=True)
class Progress:
    stage: str  # "queued", "model_load", "prompt_processing"
    fraction: float


@dataclass(frozen=True)
class Finished:
    choice_index: int
    reason: FinishReason
    completion_tokens: int
    matched_stop: str = ""
    matched_stop_token_id: int | None = None
    timings: Timings = field(default_factory=Timings)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Failed:
    """The request could not be finished (a model error, or a failure in its own output processing);
    ends the stream. ``usage`` counts what was generated before the failure."""

    message: str
    usage: Usage | None = None


Event = (
    ContentDelta
    | ReasoningDelta
    | RefusalDelta
    | ToolCallDelta
    | PromptLogprobs
    | Progress
    | Finished
    | Usage
    | Failed
)


# ------------------------------------------- from the engine core to the output processor


@dataclass(frozen=True)
class SampledLogprobs:
    """A drawn token's raw logprob and its top alternatives, as ids (texts are looked up later)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Dequeued:
    """The request left the queue for its first step (its prompt starts): when, and how many prompt
    tokens came from the prefix cache."""

    time: float
    cached_tokens: int


@dataclass(slots=True)  # not frozen: one per token (see ContentDelta)
class NewToken:
    """One token of one choice, drawn by the core at ``time``.

    ``finish`` is set when the core ended the choice with this token: STOP for EOS or a stop token id
    (``stop_token``: the token is counted but never shown), LENGTH for max_tokens or the context end,
    STOP with no ``stop_token`` when the grammar is complete.
    """

    choice_index: int
    token_id: int
    time: float
    logprobs: SampledLogprobs | None = None
    finish: FinishReason | None = None
    stop_token: int | None = None


@dataclass(frozen=True)
class PromptScored:
    """The prompt's logprobs (ids only), one entry per prompt token after the first."""

    entries: tuple[SampledLogprobs, ...]


@dataclass(frozen=True)
class ChoiceEnded:
    """The core ended a choice without drawing a token (``max_tokens`` 0: the prompt was only scored)."""

    choice_index: int
    reason: FinishReason


@dataclass(frozen=True)
class CoreFailure:
    """The core could not go on with the request (its forward pass or its grammar failed)."""

    message: str


# What the core hands a request's output processor, in order, once per step.
CoreOutput = Progress | Dequeued | PromptScored | NewToken | ChoiceEnded | CoreFailure
