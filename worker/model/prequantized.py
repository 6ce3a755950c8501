"""Loading a checkpoint published in a quantization format in its own form: ``--quantization``
checked against the format, the model built by worker/quant/checkpoint_loading.py, and one log
line naming the format, the kernel and the weights' memory. Design notes: docs/worker.md."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from worker.errors import WorkerError
from worker.quant import cuda_kernels
from worker.quant.checkpoint_formats import CheckpointFormat, UnsupportedCheckpoint, read_format
from worker.quant.checkpoint_loading import load_checkpoint_quantized
from worker.quant.layers import CHOICES, Fp8Linear, Int4Linear, Int8Linear, weight_bytes
from worker.quant.loading import DirectLoadUnsupported
from worker.quant.mxfp4 import Mxfp4Experts, float16_bytes
from worker.quant.slicing import Slicer

log = logging.getLogger(__name__)


class PrequantizedLoadError(WorkerError):
    """A quantized checkpoint refused at load (the loader names the setting it concerns)."""

    reason = "model_load_failed"


def checkpoint_format(folder: Path | None, quantization: str, task: str) -> CheckpointFormat | None:
    """The folder's quantization format, checked against ``--quantization`` (``auto`` or the
    format's own scheme) and ``--task``; None for a float checkpoint."""
    try:
        fmt = None if folder is None else read_format(folder)
    except UnsupportedCheckpoint as exc:
        raise PrequantizedLoadError(f"--model {folder}: {exc}") from exc
    if fmt is None:
        return None
    if task != "generate":
        raise PrequantizedLoadError(f"--task {task} serves float checkpoints only; {folder} is {fmt.name}")
    if quantization not in ("auto", fmt.scheme):
        own = f" (or {fmt.scheme})" if fmt.scheme in CHOICES else ""
        raise PrequantizedLoadError(
            f"--quantization {quantization}: {folder} is a {fmt.name} checkpoint, served in its own "
            f"form with --quantization auto{own}"
        )
    log.info("--quantization %s: the checkpoint's own format, %s", quantization, fmt.name)
    if fmt.warning:
        log.warning("quantized checkpoint: %s", fmt.warning)
    return fmt


def kernel_name(fmt: CheckpointFormat, device: torch.device) -> str:
    """The product each quantized layer runs, as logged."""
    if fmt.scheme == "mxfp4":
        return (
            "mxfp4 experts: each routed expert's blocks dequantized per product (lossless, no fused kernel)"
        )
    if fmt.scheme == "fp8" and fmt.block != (0, 0) and fmt.fp8_activations:
        per = f"{fmt.fp8_input_group} columns" if fmt.fp8_input_group else "token"
        return f"fp8 weights upcast per product under their block scales, inputs rounded to fp8 per {per}"
    if fmt.scheme == "fp8" and fmt.block != (0, 0):
        return "fp8 weights upcast per product under their block scales (weight-only)"
    if device.type == "cuda" and fmt.scheme in ("fp8", "int4"):
        return "CUDA kernels where they serve (the next line says which)"
    if fmt.scheme == "fp8" and fmt.fp8_activations:
        return "fp8 weights upcast per product, inputs rounded to fp8 per token (simulated, no scaled-mm)"
    if fmt.scheme == "fp8":
        return "fp8 weights upcast per product (weight-only)"
    if device.type == "cpu":
        return f"torch's CPU weight-only {fmt.scheme} kernel"
    return f"{fmt.scheme} weights dequantized per product (no fused GPU kernel yet)"


def quantized_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes the quantized layers (and MXFP4 experts) hold, their biases included, and what their
    weights take in float16."""
    held = float16 = 0
    for module in model.modules():
        if isinstance(module, (Int4Linear, Int8Linear, Fp8Linear)):
            held += sum(t.untyped_storage().nbytes() for t in module.buffers())
            float16 += 2 * module.in_features * module.out_features
        elif isinstance(module, Mxfp4Experts):
            held += sum(t.untyped_storage().nbytes() for t in module.buffers())
            float16 += float16_bytes(module)
    return held, float16


def load_prequantized(
    folder: Path,
    fmt: CheckpointFormat,
    device: torch.device,
    dtype: torch.dtype,
    slicer: Callable[[Any], Slicer] | None = None,
) -> Any:
    """The folder's causal LM with its quantized layers in their own form on ``device``; the float
    layers (norms, embeddings, an unquantized output layer) in ``dtype``. ``slicer``: a
    tensor-parallel rank's, which keeps its share of each quantized layer (the float ones are cut
    later, by the rank's ``shard``)."""
    try:
        config = AutoConfig.from_pretrained(str(folder))
        del config.quantization_config
        model, count = load_checkpoint_quantized(folder, config, fmt, device, slicer)
    except (UnsupportedCheckpoint, DirectLoadUnsupported) as exc:
        raise PrequantizedLoadError(f"--model {folder}: {exc}") from exc
    for parameter in model.parameters():
        parameter.data = parameter.data.to(device, dtype)
    held, float16 = quantized_bytes(model)
    log.info(
        "quantized checkpoint: %s, %d layers on %s; weights %.2f MiB in all, the quantized layers "
        "%.2f MiB (%.2fx their float16 size)",
        fmt.name,
        count,
        kernel_name(fmt, device),
        weight_bytes(model) / 2**20,
        held / 2**20,
        held / max(float16, 1),
    )
    words = cuda_kernels.describe(model)
    if words:
        log.info("quantized layers on CUDA: %s", words)
    return model
