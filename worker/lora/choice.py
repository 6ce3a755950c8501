"""Which batched LoRA product a device gets: torch's, or on CUDA the segmented Triton kernels once a
start-up check shows they compute what torch's does.

Design notes: docs/worker.md ("LoRA adapters").
"""

from __future__ import annotations

import logging

import torch

from worker.lora.ops import Group, LoraOps, grouped_torch

log = logging.getLogger(__name__)


def kernel_problem(ops: LoraOps, device: torch.device, dtype: torch.dtype = torch.float32) -> str | None:
    """Why ``ops`` cannot serve on ``device`` (None: it computes what :func:`grouped_torch` does
    on a small step of three adapters, one of them on scattered rows, within rounding)."""
    generator = torch.Generator().manual_seed(0)
    rows, features, outputs, slots, rank = 37, 96, 80, 3, 16
    x, a, b, base = (
        torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        for shape in ((rows, features), (slots, rank, features), (slots, outputs, rank), (rows, outputs))
    )
    a[0, 8:], b[0, :, 8:] = 0, 0  # slot 0 holds a rank-8 adapter, zero-padded as slots are
    scattered = torch.tensor([20, 22, 23, 30, 36], device=device)
    groups = (Group(2, rank, slice(0, 18)), Group(0, 8, scattered), Group(1, rank, slice(24, 30)))
    want, got = base.clone(), base.clone()
    grouped_torch(x, a, b, groups, want)
    ops(x, a, b, groups, got)
    untouched = [18, 19, 21, 31]
    if not torch.equal(got[untouched], base[untouched]):
        return "it changed rows of no adapter"
    error = float((got.float() - want.float()).abs().max()) / float(want.float().abs().max())
    return None if error < 1e-2 else f"it differs from torch's products by {error:.2e} (relative)"


def lora_ops(device: torch.device) -> LoraOps:
    """The batched LoRA product for ``device``: on CUDA the Triton kernels once :func:`kernel_problem`
    finds none (else why not, logged at ERROR, and torch's products); elsewhere torch's."""
    if device.type != "cuda":
        return grouped_torch
    try:
        from worker.lora.triton_ops import TritonLora  # needs triton

        kernel = TritonLora()
        problem = kernel_problem(kernel, device)
    except Exception as exc:  # no triton, or a kernel that fails to build or run
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        log.error("LoRA: the Triton kernels are off (%s); each adapter's rows use torch's products", problem)
        return grouped_torch
    log.info("LoRA: adapters' products on the segmented Triton kernels")
    return kernel
