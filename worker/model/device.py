"""The CUDA device each thread works on, and which errors mean the device itself has failed.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import torch

# Texts of CUDA failures that leave the context unusable (every later call fails too).
_FATAL_TEXTS = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUBLAS_STATUS_INTERNAL_ERROR",
    "cudaErrorLaunchFailure",
)


class RankFailure(RuntimeError):
    """A tensor-parallel rank failed (it exited, or a collective with it failed or timed out): the
    whole device group is unusable, like a failed device."""


def bind_device(device: torch.device | None) -> None:
    """Makes ``device`` the current CUDA device of the calling thread (a no-op elsewhere): torch's
    current device is per thread, and Triton launches and graph captures use it."""
    if device is not None and device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def prefer_planless_attention(device: torch.device) -> None:
    """On CUDA, takes cuDNN out of SDPA's backends. torch sends attention to cuDNN first on Hopper
    and newer, and cuDNN builds an execution plan for every new shape (hundreds of milliseconds),
    while a step's prompts make new shapes all the time; flash and memory-efficient attention need
    no plan. Process-wide, set before the memory probe so that it measures the kernels serving runs."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def is_fatal_device_error(error: BaseException) -> bool:
    """Whether ``error`` says the device failed (not one request: out-of-memory is not fatal)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    if isinstance(error, RankFailure):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _FATAL_TEXTS)
