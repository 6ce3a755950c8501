"""gpt-oss's MXFP4 experts (``quant_method: mxfp4``): each expert's gate_up and down weights kept as
the checkpoint's e2m1 pairs (``*_blocks``) and e8m0 scales per 32 values (``*_scales``), one routed
expert's weight dequantized per product (lossless: every MXFP4 value is exact in bfloat16).
Design notes: docs/worker.md ("Pre-quantized checkpoints")."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from worker.quant.checkpoint_formats import UnsupportedCheckpoint
from worker.quant.loading import _set_module

BLOCK = 32  # values under one e8m0 scale (the OCP MX block)
# e2m1 codes 0..15 (sign bit 3, two exponent bits, one mantissa bit) -> their values.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PROJECTIONS = ("gate_up_proj", "down_proj")
_PARTS = tuple(f"{p}_{part}" for p in PROJECTIONS for part in ("blocks", "scales", "bias"))


def _pairs() -> torch.Tensor:
    """Each byte's two e2m1 values, [256, 2]: the low nibble holds the first (even) element."""
    values, codes = torch.tensor(E2M1), torch.arange(256)
    return torch.stack([values[codes & 15], values[codes >> 4]], dim=-1)


_PAIRS = _pairs()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` uint8 [..., n / 32, 16] and ``scales`` uint8 [..., n / 32] (``2 ** (s - 127)``)
    -> the values [..., n] in ``dtype``."""
    values = _PAIRS.to(blocks.device, dtype)[blocks.long()].reshape(*scales.shape, BLOCK)
    scale = torch.exp2(scales.float() - 127).to(dtype)
    return (values * scale[..., None]).reshape(*scales.shape[:-1], -1)


class Mxfp4Experts(torch.nn.Module):
    """gpt-oss's experts on MXFP4 weights: ``{proj}_blocks`` uint8 [E, out, in / 32, 16],
    ``{proj}_scales`` uint8 [E, out, in / 32], ``{proj}_bias`` float32 [E, out]; the original module,
    its weights removed, is kept as ``gating`` for its clamped gate (``_apply_gate``)."""

    gate_up_proj_bias: torch.Tensor
    down_proj_bias: torch.Tensor

    def __init__(self, experts: Any, parts: dict[str, torch.Tensor]):
        super().__init__()
        self.num_experts = int(parts["down_proj_blocks"].shape[0])
        for name in _PARTS:
            value = parts[name]
            self.register_buffer(name, value.float() if name.endswith("bias") else value.contiguous())
        for name in (*PROJECTIONS, *(f"{p}_bias" for p in PROJECTIONS)):
            if name in experts._parameters:
                delattr(experts, name)
        self.gating: Any = experts

    def weight(self, projection: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """One expert's ``projection`` weight [out, in], dequantized (the product's only float copy)."""
        blocks, scales = getattr(self, f"{projection}_blocks"), getattr(self, f"{projection}_scales")
        return dequantize_mxfp4(blocks[expert], scales[expert], dtype)

    def _expert(self, rows: torch.Tensor, expert: int) -> torch.Tensor:
        bias_up = self.gate_up_proj_bias[expert].to(rows.dtype)
        bias_down = self.down_proj_bias[expert].to(rows.dtype)
        up = F.linear(rows, self.weight("gate_up_proj", expert, rows.dtype), bias_up)
        gated = self.gating._apply_gate(up)
        return F.linear(gated, self.weight("down_proj", expert, rows.dtype), bias_down)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden_states`` [T, H], the chosen experts and their weights [T, k] -> [T, H]; an index
        outside ``[0, E)`` (another rank's expert) is skipped, as transformers' forward does."""
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            if not 0 <= expert < self.num_experts:
                continue
            token, slot = (top_k_index == expert).nonzero(as_tuple=True)
            rows = self._expert(hidden_states[token], expert) * top_k_weights[token, slot, None]
            out.index_add_(0, token, rows.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, mxfp4 (e2m1, e8m0 scales per {BLOCK})"


def float16_bytes(experts: Mxfp4Experts) -> int:
    """What the experts' weights would take in float16."""
    return sum(2 * getattr(experts, f"{p}_scales").numel() * BLOCK for p in PROJECTIONS)


def _expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The blocks' and scales' shapes of gpt-oss's experts under ``config``."""
    count, hidden, inner = config.num_local_experts, config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for projection, (out, inp) in zip(PROJECTIONS, [(2 * inner, hidden), (hidden, inner)], strict=True):
        shapes[f"{projection}_blocks"] = (count, out, inp // BLOCK, BLOCK // 2)
        shapes[f"{projection}_scales"] = (count, out, inp // BLOCK)
    return shapes


def _experts_parts(path: str, tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Pops the six tensors of the experts module at ``path``, their names, dtypes and shapes checked."""
    missing = [name for name in _PARTS if f"{path}.{name}" not in tensors]
    if missing:
        raise UnsupportedCheckpoint(f"mxfp4: {path} has no {missing[0]}")
    parts = {name: tensors.pop(f"{path}.{name}") for name in _PARTS}
    for name, shape in _expected_shapes(config).items():
        if parts[name].dtype != torch.uint8 or tuple(parts[name].shape) != shape:
            raise UnsupportedCheckpoint(
                f"mxfp4: {path}.{name} is {parts[name].dtype} {tuple(parts[name].shape)}, not uint8 {shape}"
            )
    return parts


def load_mxfp4_experts(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], config: Any, device: torch.device
) -> int:
    """Replaces each experts module whose ``*_blocks`` and ``*_scales`` are in ``tensors`` (popped
    from it) by :class:`Mxfp4Experts` on ``device``; returns how many. MXFP4 tensors of any other
    module (an attention or dense layer) are refused by name."""
    packed = sorted(key for key in tensors if key.endswith(("_blocks", "_scales")))
    stray = [key for key in packed if key.rpartition(".")[2] not in _PARTS or ".experts." not in key]
    if stray:
        raise UnsupportedCheckpoint(f"mxfp4: {stray[0]} (only gpt-oss's experts are served in MXFP4)")
    paths = sorted({key.rpartition(".")[0] for key in packed})
    modules = dict(model.named_modules())
    for path in paths:
        experts = modules.get(path)
        if not hasattr(experts, "_apply_gate"):
            raise UnsupportedCheckpoint(f"mxfp4: {path} is no gpt-oss experts module of the model")
        parts = {k: v.to(device) for k, v in _experts_parts(path, tensors, config).items()}
        _set_module(model, path, Mxfp4Experts(experts, parts))
    return len(paths)
