"""The products of the weight-only layers on CUDA: torch's int4 kernel (tinygemm) and ``_scaled_mm``
for fp8 weights with per-token e4m3 inputs, each taken where a probe product on the device matched
the dequantized weight. Design notes: docs/worker.md ("Quantized weights on CUDA").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

INNER_K_TILES = 8  # the int4 packing's inner tiles: the input features must divide by 16 times this
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes the int4 kernel takes
_E4M3 = torch.finfo(torch.float8_e4m3fn)
# Largest relative error (Frobenius) of a probe product against the dequantized weight's: bfloat16
# rounding for int4, and e4m3 activations (3 mantissa bits) for fp8.
TOLERANCE = {"int4": 0.01, "fp8": 0.06}
KERNEL_NAMES = {"int4": "torch's int4 kernel (tinygemm)", "fp8": "_scaled_mm (fp8 activations per token)"}
BLOCKS = "fp8-block"  # block-scaled fp8 layers: no kernel here, upcast per product


def int4_fits(out_features: int, in_features: int, group: int) -> bool:
    """The int4 kernel takes a weight of this shape and group."""
    return out_features % 8 == 0 and in_features % (16 * INNER_K_TILES) == 0 and group in INT4_GROUPS


def int4_pack(q: torch.Tensor) -> torch.Tensor:
    """``q`` (values 0..15, [out, in], on CUDA) in the int4 kernel's tiled layout: two values a
    byte, the even column in the high nibble."""
    q = q.to(torch.int32)
    pairs = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack(pairs, INNER_K_TILES)


def int4_mm(
    rows: torch.Tensor, packed: torch.Tensor, group: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """``rows`` [M, in] times ``W^T`` in bfloat16, ``W = (q - 8) * scale + zero`` per group
    (``scales_and_zeros``: [in // group, out, 2] bfloat16, the layout the CPU kernel takes too)."""
    return torch.ops.aten._weight_int4pack_mm(rows.to(torch.bfloat16), packed, group, scales_and_zeros)


def fp8_fits(out_features: int, in_features: int) -> bool:
    """``_scaled_mm`` takes a weight of this shape."""
    return out_features % 16 == 0 and in_features % 16 == 0


def fp8_mm(rows: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``rows`` [M, in] times ``(qweight * scale[:, None])^T`` in bfloat16, each row rounded to e4m3
    under the scale ``max|row| / 448`` (``scale``: float32 [out])."""
    row_scale = (rows.abs().amax(dim=-1, keepdim=True).float() / _E4M3.max).clamp(min=1e-12)
    quantized = (rows.float() / row_scale).clamp(_E4M3.min, _E4M3.max).to(torch.float8_e4m3fn)
    return torch._scaled_mm(
        quantized, qweight.t(), scale_a=row_scale, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16
    )


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm().clamp(min=1e-12))


def _probe(
    kind: str, device: torch.device, minimum: tuple[int, int], product: Callable[[], float]
) -> str | None:
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    capability = torch.cuda.get_device_capability(device)
    if capability < minimum:
        return f"compute capability {capability[0]}.{capability[1]} (needs {minimum[0]}.{minimum[1]})"
    try:
        error = product()
    except (RuntimeError, NotImplementedError) as exc:  # an op this build or device lacks
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None if error <= TOLERANCE[kind] else f"a probe product differed by {error:.3f} (relative)"


@functools.cache
def int4_problem(device: torch.device) -> str | None:
    """Why the int4 kernel cannot serve on ``device`` (None: it can)."""

    def product() -> float:
        generator = torch.Generator().manual_seed(0)
        out_features, in_features, group = 256, 256, 64
        q = torch.randint(0, 16, (out_features, in_features), generator=generator)
        scale = torch.rand(in_features // group, out_features, generator=generator) * 0.01 + 1e-3
        zero = torch.randn(in_features // group, out_features, generator=generator) * 0.01
        rows = torch.randn(5, in_features, generator=generator).to(torch.bfloat16)
        packed = int4_pack(q.to(device))
        both = torch.stack([scale, zero], dim=-1).to(device, torch.bfloat16)
        # The reference from the same bfloat16 scales and offsets the kernel reads.
        kernel_scale, kernel_zero = both[..., 0].float().t().cpu(), both[..., 1].float().t().cpu()
        grouped = (q.float() - 8).reshape(out_features, -1, group) * kernel_scale[..., None] + kernel_zero[
            ..., None
        ]
        want = rows.float() @ grouped.reshape(out_features, in_features).t()
        return _relative_error(int4_mm(rows.to(device), packed, group, both).cpu(), want)

    return _probe("int4", device, (8, 0), product)


@functools.cache
def fp8_problem(device: torch.device) -> str | None:
    """Why ``_scaled_mm`` cannot serve fp8 weights on ``device`` (None: it can)."""

    def product() -> float:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(256, 512, generator=generator)
        scale = (weight.abs().amax(dim=1) / _E4M3.max).clamp(min=1e-12)
        qweight = (weight / scale[:, None]).clamp(_E4M3.min, _E4M3.max).to(torch.float8_e4m3fn)
        rows = torch.randn(5, 512, generator=generator).to(torch.bfloat16)
        want = rows.float() @ (qweight.float() * scale[:, None]).t()
        got = fp8_mm(rows.to(device), qweight.to(device), scale.to(device))
        return _relative_error(got.cpu(), want)

    return _probe("fp8", device, (8, 9), product)


def _quantized(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's layers with a CUDA kernel of their kind (``kernel_kind``: worker/quant/layers.py)."""
    return [m for m in model.modules() if getattr(type(m), "kernel_kind", None) in (*KERNEL_NAMES, BLOCKS)]


def on_kernels(model: torch.nn.Module) -> bool | None:
    """Every int4 and fp8 layer of ``model`` runs its CUDA kernel (None: it has none; the
    fast-path metric's ``quant`` part)."""
    layers = _quantized(model)
    return all(bool(getattr(m, "on_cuda_kernel", False)) for m in layers) if layers else None


def describe(model: torch.nn.Module, device: torch.device | None = None) -> str | None:
    """The start-up log's words for the quantized layers of a model on CUDA: how many run their
    kernel, and why the others do not (None: no int4 or fp8 layer on CUDA). A layer class names its
    kernel in ``kernel_kind`` (worker/quant/layers.py); ``device``: the layers' (read off them)."""
    counts: dict[str, list[int]] = {}
    for module in _quantized(model):
        tally = counts.setdefault(type(module).kernel_kind, [0, 0])  # type: ignore[attr-defined]
        tally[0] += int(bool(getattr(module, "on_cuda_kernel", False)))
        tally[1] += 1
        device = device or next(module.buffers()).device
    if device is None or device.type != "cuda":
        return None
    words = []
    for kind, (on, total) in counts.items():
        if kind == BLOCKS:
            words.append(f"{total} fp8 layers with block scales upcast per product (no block-scaled kernel)")
            continue
        problem = int4_problem(device) if kind == "int4" else fp8_problem(device)
        why = f" ({problem})" if problem else " (the others' shapes do not fit it)" if on < total else ""
        words.append(f"{on} of {total} {kind} layers on {KERNEL_NAMES[kind]}{why}")
    return "; ".join(words)
