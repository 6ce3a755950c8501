"""The request contract's limits (sluice/limits.py): written once, and the edge's request models and
the worker's conversion accept exactly the same values."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from edge.errors import InvalidRequestError
from edge.surfaces.shared.chat_request import parse_chat_request
from sluice import limits
from sluice.v1 import worker_pb2 as pb
from worker.errors import InvalidRequest
from worker.service.convert import sampling_options

REPO = Path(__file__).resolve().parents[2]
CONTRACT = {
    *(name for name in vars(limits) if name.isupper()),
    # the names they had on one side or the other
    "MAX_TEMPERATURE",
    "MAX_INPUTS",
    "MAX_PAIRS",
}


def assigned_names(path: Path) -> set[str]:
    """Names a module assigns at its top level."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_each_contract_limit_is_defined_once() -> None:
    defined = {
        f"{path.relative_to(REPO)}: {name}"
        for package in ("edge", "worker", "sluice")
        for path in sorted((REPO / package).rglob("*.py"))
        if path != REPO / "sluice" / "limits.py"
        for name in assigned_names(path) & CONTRACT
    }
    assert not defined, f"the contract's limits live in sluice/limits.py only: {sorted(defined)}"


def edge_accepts(field: str, value: float, **extra: object) -> bool:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value, **extra}
    try:
        parse_chat_request(body)
    except InvalidRequestError as error:
        assert error.param == field
        return False
    return True


def worker_accepts(field: str, value: float) -> bool:
    params = pb.SamplingParams(**{field: value})
    try:
        sampling_options(params, prompt_tokens=1, context_length=100, vocab_size=100)
    except InvalidRequest:
        return False
    return True


RANGES = {
    "temperature": limits.TEMPERATURE,
    "top_p": limits.TOP_P,
    "min_p": limits.MIN_P,
    "presence_penalty": limits.PENALTY,
    "frequency_penalty": limits.PENALTY,
    "repetition_penalty": limits.REPETITION_PENALTY,
}


@pytest.mark.parametrize("field", sorted(RANGES))
def test_edge_and_worker_accept_the_same_range(field: str) -> None:
    accepted = RANGES[field]
    for value in (accepted.low - 0.5, accepted.low, accepted.low + 0.25, accepted.high, accepted.high + 0.5):
        assert edge_accepts(field, value) == worker_accepts(field, value) == (value in accepted), value


def test_edge_and_worker_share_the_counts() -> None:
    for value, ok in ((limits.MAX_N, True), (limits.MAX_N + 1, False)):
        assert edge_accepts("n", value) == worker_accepts("n", value) == ok, value
    for value, ok in ((limits.MAX_TOP_LOGPROBS, True), (limits.MAX_TOP_LOGPROBS + 1, False)):
        assert edge_accepts("top_logprobs", value, logprobs=True) == worker_accepts("logprobs", value) == ok
