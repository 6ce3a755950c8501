"""The model-load fraction the worker reports while it starts, and its wire form."""

from __future__ import annotations

import asyncio

import grpc

from sluice.status import ErrorDetails, build_status, read_details
from worker.errors import ModelLoading
from worker.model.load_progress import LoadProgress, wait_for_load


def test_the_fraction_only_rises_and_stays_in_range() -> None:
    progress = LoadProgress()
    progress.advance(0.5)
    progress.advance(0.2)
    assert progress.fraction == 0.5
    progress.advance(7.0)
    assert progress.fraction == 1.0


def test_waiting_yields_changes_and_ends_when_loaded() -> None:
    progress = LoadProgress()
    loaded: list[bool] = []

    async def body() -> list[float]:
        seen: list[float] = []
        async for fraction in wait_for_load(progress, lambda: bool(loaded), wait_s=30):
            seen.append(fraction)
            if fraction == 0.0:
                progress.advance(0.6)
            else:
                loaded.append(True)
        return seen

    assert asyncio.run(body()) == [0.0, 0.6]


def test_waiting_ends_after_its_bound_while_still_loading() -> None:
    async def body() -> list[float]:
        return [f async for f in wait_for_load(LoadProgress(), lambda: False, wait_s=0.3)]

    assert asyncio.run(body()) == [0.0]


def test_model_loading_status_carries_the_fraction() -> None:
    status = ModelLoading("loading", load_fraction=0.25, retry_after_seconds=5.0).to_status()
    assert status.code == grpc.StatusCode.UNAVAILABLE

    class Failed(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return status.code

        def details(self) -> str:
            return status.details

        def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
            return tuple(status.trailing_metadata)

    details = read_details(Failed())
    assert (details.reason, details.load_fraction, details.retry_after_seconds) == (
        "model_loading",
        0.25,
        5.0,
    )
    plain = build_status(ErrorDetails(grpc.StatusCode.UNAVAILABLE, "x", "not_ready"))
    assert all(b"load_fraction" not in bytes(v) for k, v in plain.trailing_metadata if isinstance(v, bytes))
