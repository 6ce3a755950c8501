"""Worker events the surface translation tests share (reasoning, tool calls, refusals, progress)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from sluice.v1 import worker_pb2


def reasoning(text: str, tokens: int = 1) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        reasoning=worker_pb2.ReasoningDelta(text=text, token_ids=list(range(tokens)))
    )


def tool_call(index: int, arguments: str, name: str = "", call_id: str = "") -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        tool_call=worker_pb2.ToolCallDelta(tool_index=index, id=call_id, name=name, arguments=arguments)
    )


def refusal(text: str) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(refusal=worker_pb2.RefusalDelta(text=text))


def progress(
    fraction: float, stage: int = worker_pb2.Progress.PROMPT_PROCESSING
) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(progress=worker_pb2.Progress(stage=stage, fraction=fraction))  # type: ignore[arg-type]


def finished_with(
    reason: int = worker_pb2.STOP,
    tokens: int = 2,
    matched_stop: str = "",
    ttft: float = 0.0,
    decode: float = 0.0,
) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        finished=worker_pb2.Finished(
            reason=reason,  # type: ignore[arg-type]
            completion_tokens=tokens,
            matched_stop=matched_stop,
            timings=worker_pb2.Timings(time_to_first_token_seconds=ttft, decode_seconds=decode),
        )
    )


def usage_with(
    prompt: int, completion: int, cached: int = 0, reasoning_tokens: int = 0
) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        usage=worker_pb2.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            cached_tokens=cached,
            reasoning_tokens=reasoning_tokens,
        )
    )


def counter_ids() -> Callable[[str], str]:
    """Deterministic ids: ``<prefix>_1``, ``<prefix>_2``, ... (one counter for all prefixes)."""
    numbers = itertools.count(1)
    return lambda prefix: f"{prefix}_{next(numbers)}"
