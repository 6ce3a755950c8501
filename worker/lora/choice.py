"""Which batched LoRA products a device gets: torch's, or on CUDA the Triton kernels (segmented for
eager steps, per row for the decode graphs) once a start-up check shows they compute what torch's
does.

Design notes: docs/worker.md ("LoRA adapters").
"""

from __future__ import annotations

import logging

import torch

from worker.lora.ops import Group, LoraOps, RowLoraOps, grouped_torch, slotted_torch

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


def row_kernel_problem(
    ops: RowLoraOps, device: torch.device, dtype: torch.dtype = torch.float32
) -> str | None:
    """Why per-row ``ops`` cannot serve on ``device`` (None: on rows of three slots, one of them a
    rank-8 adapter, and rows of none, it adds what :func:`grouped_torch` adds for the same groups
    within rounding, and leaves the rows of none as they were)."""
    generator = torch.Generator().manual_seed(0)
    rows, features, outputs, slots, rank = 21, 96, 80, 3, 16
    x, a, b, base = (
        torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        for shape in ((rows, features), (slots, rank, features), (slots, outputs, rank), (rows, outputs))
    )
    a[0, 8:], b[0, :, 8:] = 0, 0  # slot 0 holds a rank-8 adapter, zero-padded as slots are
    row_slots = [2, 2, -1, 0, 1, 0, -1, 2, 1, 1, -1, 0, 2, 2, 2, -1, 0, 1, 2, 0, -1]
    indexes = [[i for i, s in enumerate(row_slots) if s == slot] for slot in range(slots)]
    groups = [
        Group(slot, 8 if slot == 0 else rank, torch.tensor(rows, device=device))
        for slot, rows in enumerate(indexes)
    ]
    want, got = base.clone(), base.clone()
    grouped_torch(x, a, b, groups, want)
    ops(x, a, b, torch.tensor(row_slots, dtype=torch.long, device=device), got)
    untouched = [i for i, slot in enumerate(row_slots) if slot < 0]
    if not torch.equal(got[untouched], base[untouched]):
        return "it changed rows of no adapter"
    error = float((got.float() - want.float()).abs().max()) / float(want.float().abs().max())
    return None if error < 1e-2 else f"it differs from torch's products by {error:.2e} (relative)"


def lora_row_ops(device: torch.device) -> RowLoraOps:
    """The per-row LoRA product the decode graphs capture: on CUDA the Triton row kernels once
    :func:`row_kernel_problem` finds none (else why not, logged at ERROR, and torch's products
    per slot, :func:`slotted_torch`, graph-safe but ``--max-loras`` times the rows' products);
    elsewhere torch's."""
    if device.type != "cuda":
        return slotted_torch
    try:
        from worker.lora.triton_ops import TritonRowLora  # needs triton

        kernel = TritonRowLora()
        problem = row_kernel_problem(kernel, device)
    except Exception as exc:  # no triton, or a kernel that fails to build or run
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        log.error(
            "LoRA: the per-row Triton kernels are off (%s); captured decode steps use torch's "
            "products for every slot",
            problem,
        )
        return slotted_torch
    log.info("LoRA: captured decode steps' adapter products on the per-row Triton kernels")
    return kernel
