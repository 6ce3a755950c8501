"""A pre-quantized checkpoint's tensors mapped straight into the worker's quantized layers (the
float weights of its quantized layers are never built); the format is checkpoint_formats.py's.
Design notes: docs/worker.md ("Pre-quantized checkpoints")."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from worker.quant.act_order import ActOrderInt4Linear, group_order
from worker.quant.checkpoint_formats import CheckpointFormat, UnsupportedCheckpoint
from worker.quant.fp8_activations import Fp8BlockDynamicLinear, Fp8DynamicLinear
from worker.quant.fp8_blocks import Fp8BlockLinear, fp8_block_layer
from worker.quant.layers import Fp8Linear, Int4Linear, Int8Linear, QuantizedLinear
from worker.quant.loading import _empty_model, _finish, _safetensors_files, _set_module, _set_parameter
from worker.quant.mxfp4 import load_mxfp4_experts
from worker.quant.slicing import WHOLE, Slicer

log = logging.getLogger(__name__)

# The tensor names of a quantized linear layer, per format (the layer's own ``bias`` aside).
_PARTS = {
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "fp8": ("weight_scale_inv",),
}
# AutoAWQ's GEMM words hold output columns 0, 2, 4, 6, 1, 3, 5, 7 in nibbles 0..7: column j is nibble
# _AWQ_NIBBLE[j] (its interleaving for the fast dequantize of its CUDA kernel).
_AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The unsigned ``bits``-bit values packed along the last dimension of ``packed`` (int32, the
    first value in the lowest bits), as int32."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * bits
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing read back: int32 [rows, cols / 8] -> the 4-bit values [rows, cols]."""
    nibbles = unpack_int32(packed, 4).reshape(*packed.shape, 8)
    order = torch.tensor(_AWQ_NIBBLE, device=packed.device)
    return nibbles.index_select(-1, order).reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def _int4_layer(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    name: str,
    order: torch.Tensor | None = None,
) -> Int4Linear:
    """An :class:`Int4Linear` of ``q`` (0..15, [out, in]) without the float batch copy; with
    ``order`` (act-order) an :class:`ActOrderInt4Linear` over its input features in that order."""
    if q.device.type == "cpu" and q.shape[0] % 16:
        raise UnsupportedCheckpoint(
            f"{name}: {q.shape[0]} output rows (the CPU int4 kernel packs 16 at a time)"
        )
    if order is not None:
        return ActOrderInt4Linear(q, scale, zero, group, order)
    return Int4Linear(q, scale, zero, group=group, batch_copy=False)


def _fp8_blocks(
    parts: dict[str, torch.Tensor], block: tuple[int, int], name: str, slicer: Slicer, input_group: int = 0
) -> Fp8BlockLinear:
    """A block-wise FP8 layer (:func:`fp8_block_layer` checks the whole layer's tiles), cut by
    ``slicer`` (whose cut may refine the tiles' rows: the same scales, repeated)."""
    whole = fp8_block_layer(parts, block, name)
    weight, scale, block = slicer.blocks(name, whole.qweight, whole.scale, block, input_group)
    return (
        whole if weight is whole.qweight else Fp8BlockLinear(weight.contiguous(), scale.contiguous(), block)
    )


def _offset_zero(zero: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``W = (q - zero) * scale`` as :class:`Int4Linear`'s ``(q - 8) * scale + offset``: the offset."""
    return (8 - zero.float()) * scale


def compressed_tensors_layer(
    parts: dict[str, torch.Tensor], fmt: CheckpointFormat, name: str, slicer: Slicer = WHOLE
) -> QuantizedLinear:
    """A layer of compressed-tensors' ``float-quantized`` (fp8 ``weight`` and ``weight_scale``) or
    ``pack-quantized`` (``weight_packed`` int32, ``weight_scale`` [out, groups], ``weight_shape``)."""
    scale = parts["weight_scale"].float()
    if fmt.scheme == "fp8" and fmt.block != (0, 0):  # the FP8-block scheme: scales per tile
        blocks = _fp8_blocks(
            {"weight": parts["weight"], "weight_scale_inv": scale},
            fmt.block,
            name,
            slicer,
            fmt.fp8_input_group,
        )
        if not fmt.fp8_activations:
            return blocks
        return Fp8BlockDynamicLinear(blocks.qweight, blocks.scale, blocks.block, fmt.fp8_input_group)
    if fmt.scheme == "fp8":
        weight = parts["weight"]
        if weight.dtype != torch.float8_e4m3fn:
            raise UnsupportedCheckpoint(f"{name}.weight is {weight.dtype}, not float8_e4m3fn")
        layer = Fp8DynamicLinear if fmt.fp8_activations else Fp8Linear
        weight, scale = slicer.per_row(name, weight, scale.reshape(-1).expand(weight.shape[0]))
        return layer(weight.contiguous(), scale.contiguous())
    out_features, in_features = (int(v) for v in parts["weight_shape"].tolist())
    bits = 4 if fmt.scheme == "int4" else 8
    q = unpack_int32(parts["weight_packed"], bits)[:, :in_features]
    if fmt.scheme == "int8":
        q, scale = slicer.per_row(name, (q - 128).to(torch.int8), scale.reshape(out_features))
        return Int8Linear(q.contiguous(), scale.contiguous(), batch_copy=False)
    scale = scale.t().contiguous()  # [groups, out], the layer's layout
    if not fmt.zero_points:
        zero = torch.zeros_like(scale)
    elif "weight_zero_point" not in parts:
        raise UnsupportedCheckpoint(f"{name}: an asymmetric scheme without weight_zero_point")
    else:  # packed along the output rows ([out / 8, groups]), each the signed zero plus 8 as the weights
        zero = _offset_zero(unpack_int32(parts["weight_zero_point"].t(), 4)[:, :out_features], scale)
    q, scale, zero, _ = slicer.int4(name, q, scale, zero, None, fmt.group)
    return _int4_layer(q, scale, zero, fmt.group, name)


def gptq_layer(
    parts: dict[str, torch.Tensor], fmt: CheckpointFormat, name: str, slicer: Slicer = WHOLE
) -> Int4Linear:
    """A GPTQ layer: ``qweight`` [in/8, out] and ``qzeros`` [groups, out/8] (int32, 4-bit values),
    ``scales`` [groups, out]; ``W[n, k] = (q - zero) * scale`` becomes the layer's
    ``(q - 8) * scale + (8 - zero) * scale``. A ``g_idx`` that reorders the groups (act-order)
    puts the input features in group order once (:mod:`worker.quant.act_order`)."""
    q = unpack_int32(parts["qweight"].t(), 4).contiguous()  # [out, in]
    zero = unpack_int32(parts["qzeros"], 4)[:, : q.shape[0]] + fmt.gptq_zero_offset
    scale = parts["scales"].float()
    q, scale, offset, g_idx = slicer.int4(
        name, q, scale, _offset_zero(zero, scale), parts.get("g_idx"), fmt.group
    )
    order = None if g_idx is None else group_order(g_idx, fmt.group, name)
    return _int4_layer(q.contiguous(), scale.contiguous(), offset.contiguous(), fmt.group, name, order)


def awq_layer(
    parts: dict[str, torch.Tensor], fmt: CheckpointFormat, name: str, slicer: Slicer = WHOLE
) -> Int4Linear:
    """An AWQ (GEMM) layer: ``qweight`` [in, out / 8] and ``qzeros`` [groups, out / 8] packed along the
    output in AutoAWQ's nibble order, ``scales`` [groups, out]; ``W[n, k] = (q - zero) * scale``."""
    q = unpack_awq(parts["qweight"]).t().contiguous()  # [out, in]
    zero = unpack_awq(parts["qzeros"])[:, : q.shape[0]]
    scale = parts["scales"].float()
    q, scale, offset, _ = slicer.int4(name, q, scale, _offset_zero(zero, scale), None, fmt.group)
    return _int4_layer(q.contiguous(), scale.contiguous(), offset.contiguous(), fmt.group, name)


def _quantized_parts(names: set[str], fmt: CheckpointFormat) -> dict[str, str]:
    """Each checkpoint tensor of a quantized layer -> its layer's path (a float layer has none)."""
    parts = (*_PARTS[fmt.method], *(("weight",) if fmt.scheme == "fp8" else ()))
    layers = {
        name.rpartition(".")[0]
        for name in names
        if name.endswith((".weight_packed", ".weight_scale", ".qweight", ".weight_scale_inv"))
    }
    return {
        name: name.rpartition(".")[0]
        for name in names
        if name.rpartition(".")[0] in layers and name.rpartition(".")[2] in parts
    }


def _read(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (as stored: packed stays packed)."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[key] = handle.get_tensor(key)
    return tensors


def _build_layer(
    parts: dict[str, torch.Tensor], fmt: CheckpointFormat, name: str, slicer: Slicer
) -> QuantizedLinear:
    layer: QuantizedLinear
    if fmt.method == "gptq":
        layer = gptq_layer(parts, fmt, name, slicer)
    elif fmt.method == "awq":
        layer = awq_layer(parts, fmt, name, slicer)
    elif fmt.method == "fp8":
        layer = _fp8_blocks(parts, fmt.block, name, slicer)
    else:
        layer = compressed_tensors_layer(parts, fmt, name, slicer)
    if "bias" in parts:
        layer.bias = slicer.bias(name, parts["bias"]).float()
    return layer


def _check_places(model: torch.nn.Module, paths: set[str], fmt: CheckpointFormat) -> None:
    """Refuses, naming it, a quantized layer of the checkpoint that is no linear layer of the model:
    an MoE block's per-expert layers (``experts.0.gate_proj``: the model fuses its experts into 3-D
    parameters, which these layers do not replace) or a name the model does not have."""
    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    for path in sorted(paths - linears):
        if re.search(r"\.experts\.\d+\.", path):
            raise UnsupportedCheckpoint(
                f"{fmt.name}: per-expert quantized weights of an MoE block ({path}) are not served "
                "(the model holds its experts as fused 3-D parameters)"
            )
        raise UnsupportedCheckpoint(f"{fmt.name}: {path} is no linear layer of the model")


def _place_layers(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    fmt: CheckpointFormat,
    device: torch.device,
    slicer: Slicer,
) -> int:
    """Pops each quantized linear layer's tensors (and bias) from ``tensors`` and puts the layer in
    ``model``, cut by ``slicer``; returns how many."""
    owners = _quantized_parts(set(tensors), fmt)
    _check_places(model, set(owners.values()), fmt)
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, path in owners.items():
        layers.setdefault(path, {})[key.rpartition(".")[2]] = tensors.pop(key).to(device)
    for path, parts in layers.items():
        bias = tensors.pop(f"{path}.bias", None)
        bias = None if bias is None else bias.to(device)
        built = _build_layer(parts if bias is None else {**parts, "bias": bias}, fmt, path, slicer)
        _set_module(model, path, built)
    return len(layers)


@torch.no_grad()
def load_checkpoint_quantized(
    folder: Path,
    config: Any,
    fmt: CheckpointFormat,
    device: torch.device,
    slicer: Callable[[Any], Slicer] | None = None,
) -> tuple[torch.nn.Module, int]:
    """The folder's model with each quantized layer in its own form, built on ``device`` (on the CPU
    the int4 layers pack for torch's kernel); returns it and the count of quantized layers. Layers
    the checkpoint left in float (often ``lm_head``) stay float32. ``slicer``: a tensor-parallel
    rank's, given ``config``, which keeps that rank's share of each quantized layer."""
    tensors = _read(folder)
    model = _empty_model(config)
    if fmt.method == "mxfp4":
        count = load_mxfp4_experts(model, tensors, config, device)
    else:
        count = _place_layers(model, tensors, fmt, device, WHOLE if slicer is None else slicer(config))
    for key, value in tensors.items():
        _set_parameter(model, key, value.float() if value.is_floating_point() else value)
    if model.get_submodule("lm_head").weight.device.type == "meta" and getattr(
        config, "tie_word_embeddings", False
    ):
        model.get_submodule("lm_head").weight = model.get_submodule("model.embed_tokens").weight
    return _finish(model, config), count
