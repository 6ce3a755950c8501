"""GGUF quantized blocks read as they are and repacked into the quantized layers.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from worker.quant.layers import INT4_GROUP, Int4Linear, Int8Linear, QuantizedLinear, quantize_weight
from worker.quant.slicing import WHOLE, Slicer

BLOCK = 32


class GGUFMatrix(Protocol):
    """A GGUF tensor as ``gguf.GGUFMatrix`` or :class:`worker.quant.gguf_file.GGUFTensor` gives it."""

    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray
    shape: Any  # GGUF order, innermost first: (in, out) for a matrix


_BLOCK_BYTES = {GGMLQuantizationType.Q8_0: 34, GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
REPACKED = tuple(_BLOCK_BYTES)


def _blocks(tensor: GGUFMatrix, rows: np.ndarray | None) -> np.ndarray:
    """The tensor's raw blocks as uint8 [out, in / 32, block bytes], rows reordered by ``rows``."""
    raw = np.asarray(tensor.data, dtype=np.uint8)
    out_features = int(tensor.shape[1])
    blocks = raw.reshape(out_features, -1, _BLOCK_BYTES[tensor.tensor_type])
    return blocks if rows is None else blocks[rows]


def _f16(blocks: np.ndarray, offset: int) -> torch.Tensor:
    field = np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(field.astype(np.float32))


def _nibbles(packed: np.ndarray) -> torch.Tensor:
    """[out, blocks, 16] bytes -> [out, blocks * 32] values 0..15 in weight order."""
    low, high = packed & 0x0F, packed >> 4
    values = np.concatenate([low, high], axis=-1)  # weights 0..15, then 16..31 of each block
    return torch.from_numpy(values.reshape(values.shape[0], -1).astype(np.int32))


def dequantized(tensor: GGUFMatrix, rows: np.ndarray | None = None) -> torch.Tensor:
    """Any GGUF tensor as float32, shaped [out, in] for a matrix (one tensor's worth of memory)."""
    values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    shape = [int(d) for d in reversed(tensor.shape)]
    weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a writable copy
    return weight if rows is None else weight[torch.from_numpy(rows)]


def repacked_linear(
    tensor: GGUFMatrix,
    scheme: str,
    rows: np.ndarray | None = None,
    slicer: Slicer = WHOLE,
    path: str = "",
) -> QuantizedLinear:
    """A quantized layer holding the GGUF matrix ``tensor`` (rows reordered by ``rows``), cut by a
    tensor-parallel rank's ``slicer`` (``path``: the layer's) to the whole layer's slice.

    ``scheme`` is the worker's choice (``int8`` or ``int4``). Q4_0/Q4_1 blocks go into an
    :class:`Int4Linear` as they are when ``scheme`` is int4; a Q8_0 tensor always becomes an
    :class:`Int8Linear` (int4 would throw away precision the file keeps, and the file keeps 8 bits
    where it matters, such as the tied embedding and output layer). Anything else is dequantized and
    quantized to ``scheme`` (int4's groups and an int8 layer's rows quantized whole, then cut).
    """
    kind = tensor.tensor_type
    if kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1) and scheme == "int4":
        q, scale, zero, _ = slicer.int4(path, *int4_parts_from_q4(tensor, rows), None, INT4_GROUP)
        return Int4Linear(q.contiguous(), scale.contiguous(), zero.contiguous(), group=INT4_GROUP)
    if kind == GGMLQuantizationType.Q8_0:
        whole: QuantizedLinear = int8_from_q8_0(tensor, rows)
    elif scheme == "int4" and slicer is not WHOLE:  # quantized in groups: the slice's are the whole's
        weight, _ = slicer.per_row(path, dequantized(tensor, rows), torch.ones(int(tensor.shape[1])))
        return quantize_weight(scheme, weight.contiguous())
    else:
        whole = quantize_weight(scheme, dequantized(tensor, rows))
    if slicer is WHOLE or not isinstance(whole, Int8Linear):
        return whole
    q, scale = slicer.per_row(path, whole.qweight, whole.scale)
    return Int8Linear(q.contiguous(), scale.contiguous())


def int4_parts_from_q4(
    tensor: GGUFMatrix, rows: np.ndarray | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks as :class:`Int4Linear`'s parts: the 4-bit values [out, in], and each
    block's scale and offset [in / 32, out] (no dequantizing)."""
    blocks = _blocks(tensor, rows)
    scale = _f16(blocks, 0)
    if tensor.tensor_type == GGMLQuantizationType.Q4_1:
        # w = d q + m = d (q - 8) + (m + 8 d)
        zero, quants = _f16(blocks, 2) + 8 * scale, blocks[..., 4:]
    else:
        zero, quants = torch.zeros_like(scale), blocks[..., 2:]
    return _nibbles(quants), scale.t().contiguous(), zero.t().contiguous()


def int4_from_q4(tensor: GGUFMatrix, rows: np.ndarray | None = None) -> Int4Linear:
    """Q4_0 / Q4_1 blocks as an :class:`Int4Linear` without dequantizing (same 4-bit values)."""
    return Int4Linear(*int4_parts_from_q4(tensor, rows), group=INT4_GROUP)


def int8_from_q8_0(tensor: GGUFMatrix, rows: np.ndarray | None = None) -> Int8Linear:
    """Q8_0 blocks (one scale per 32 weights) requantized to one scale per row."""
    blocks = _blocks(tensor, rows)
    scale = _f16(blocks, 0)
    quants = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float32))
    weight = (quants * scale[..., None]).reshape(blocks.shape[0], -1)
    return Int8Linear.from_float(weight)
