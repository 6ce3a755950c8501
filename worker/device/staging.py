"""Copies between host and device that do not block the host: host-built values to the device (the
step's inputs, sampling parameters, the grouped prompts' indexes), results back to pinned memory,
and the fence the host waits on before reading them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def staged(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``: built on the host (pinned where the device is CUDA) and
    copied without blocking the host; on the CPU, the host tensor itself."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied to pinned host memory without blocking (a CUDA tensor: read it after a
    :func:`fence` taken later), or itself (the CPU)."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def fence(device: torch.device) -> Callable[[], None]:
    """A callable that returns once the work queued on ``device`` so far is done (a CUDA event; a
    no-op on the CPU, where every operation has finished when it returns)."""
    if device.type != "cuda":
        return _done
    event = torch.cuda.Event()
    event.record()
    return event.synchronize


def _done() -> None:
    """Nothing to wait for."""
