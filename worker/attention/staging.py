"""Host-built values copied to the device without blocking the host (the step's inputs, sampling
parameters, the grouped prompts' indexes)."""

from __future__ import annotations

from typing import Any

import torch


def staged(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``: built on the host (pinned where the device is CUDA) and
    copied without blocking the host; on the CPU, the host tensor itself."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
