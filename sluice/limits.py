"""The request contract's limits, one value each: the edge's request models refuse what lies outside
them (a 400 naming the field) and the worker's conversion refuses the same (``INVALID_ARGUMENT``),
so the two sides cannot disagree. docs/grpc.md, "Sampling fields", lists them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Choices (``n``) one request may ask for. A worker serves at most min(MAX_N, its --max-running)
# and reports that in ``ModelInfo.max_n``; the edge's --max-n may only lower it.
MAX_N = 16
# ``top_logprobs`` (a completions request's ``logprobs``) and ``prompt_logprobs``.
MAX_TOP_LOGPROBS = 20
MAX_BAD_WORDS = 256
MAX_STOP_STRINGS = 16
# The most inputs (embeddings) or pairs (scores, rerank documents) one pooling call may carry
# (OpenAI's embeddings limit).
MAX_POOLED_INPUTS = 2048
# ``stream_interval_ms``: the longest window a worker keeps a stream's tokens back for (longer is
# no longer streaming); the edge gives at most this, whatever its --stream-write-interval.
MAX_STREAM_INTERVAL_MS = 1000
# The largest value of a proto ``int32`` field (max_tokens, token ids, logprobs ...).
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """The accepted values of a number field: ``low`` to ``high``, both included unless
    ``low_open`` (then ``low`` itself is refused)."""

    low: float
    high: float
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        """False for NaN, as for anything outside."""
        above_low = value > self.low if self.low_open else value >= self.low
        return above_low and value <= self.high

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low}, {self.high}]"


TEMPERATURE = Range(0, 2)
TOP_P = Range(0, 1, low_open=True)
MIN_P = Range(0, 1)
# ``presence_penalty`` and ``frequency_penalty``.
PENALTY = Range(-2, 2)
REPETITION_PENALTY = Range(0, 10, low_open=True)
# The value of each ``logit_bias`` entry.
LOGIT_BIAS = Range(-100, 100)
