"""What a failure in the engine's step loop costs: the requests it belongs to, or, where the engine's
state can no longer be trusted, the engine itself (its owner reports NOT_SERVING and exits non-zero).

Design notes: docs/worker.md ("Failure isolation").
"""

from __future__ import annotations

from worker.model.device import is_fatal_device_error


class EngineFailure(Exception):
    """The engine cannot go on: every request fails, the step loop ends and the worker exits to be
    restarted (its device failed, its block accounting no longer adds up, or its outputs cannot be
    delivered)."""


class DeviceFailure(EngineFailure):
    """The device failed during a step (:func:`worker.model.device.is_fatal_device_error`): every
    later step would fail too."""


def raise_if_device_failed(error: BaseException) -> None:
    """Raises :class:`DeviceFailure` from ``error`` when it says the device failed; else returns, and
    the caller fails the requests the error belongs to."""
    if is_fatal_device_error(error):
        raise DeviceFailure(f"{type(error).__name__}: {error}") from error


def failure_message(error: BaseException) -> str:
    """What a request failed by ``error`` is told (its type only: details go to the log)."""
    return f"generation failed: {type(error).__name__}"
