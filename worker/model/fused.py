"""Fused kernels in a model's forward on CUDA: RMSNorm, SiLU·mul and rotary as one Triton kernel
each, swapped in per module class once a check at load shows it computes what the class computes.

Design notes: docs/worker.md ("Fused kernels").
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from worker.attention.triton_decode import triton_available

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SILU_BLOCK = 1024


# Triton's CPU interpreter (the tests' child processes set it before importing anything).
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _launchable(*tensors: torch.Tensor) -> bool:
    """CUDA tensors of one supported type (CPU ones only under triton's interpreter, for tests)."""
    first = tensors[0]
    return all(
        t.dtype == first.dtype and t.device == first.device and (t.is_cuda or _INTERPRETING) for t in tensors
    ) and (first.dtype in _DTYPES)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_in_fp32: bool) -> torch.Tensor:
    """RMSNorm over the last dimension (see ``rms_norm_kernel`` for the two forms)."""
    import triton

    from worker.model.fused_kernels import rms_norm_kernel

    columns = x.shape[-1]
    rows = x.reshape(-1, columns)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.view(x.shape)
    block = triton.next_power_of_2(columns)
    rms_norm_kernel[(rows.shape[0],)](
        rows,
        weight,
        out,
        rows.stride(0),
        out.stride(0),
        columns,
        eps,
        BLOCK=block,
        SCALE_IN_FP32=scale_in_fp32,
        num_warps=min(16, max(1, block // 256)),
    )
    return out.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass."""
    import triton

    from worker.model.fused_kernels import silu_mul_kernel

    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    count = gate.numel()
    if count == 0:
        return out
    silu_mul_kernel[(triton.cdiv(count, _SILU_BLOCK),)](gate, up, out, count, BLOCK=_SILU_BLOCK, num_warps=4)
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [batch, heads, tokens, dim]`` (any strides) and
    ``cos``/``sin`` ``[batch, tokens, dim]``; the result has ``x``'s layout."""
    import triton

    from worker.model.fused_kernels import rotary_kernel

    batch, heads, tokens, dim = x.shape
    cos_rows, sin_rows = cos.reshape(-1, dim).contiguous(), sin.reshape(-1, dim).contiguous()
    out = torch.empty_like(x)
    if out.numel() == 0:
        return out
    half = dim // 2
    rotary_kernel[(batch * tokens, heads)](
        x,
        cos_rows,
        sin_rows,
        out,
        tokens,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        cos_rows.stride(0),
        half,
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=1 if half <= 64 else 2,
    )
    return out


class _FusedNorm:
    """A norm module's forward: the kernel for inputs it takes, the module's own otherwise."""

    def __init__(self, module: nn.Module, eps: float, scale_in_fp32: bool, own: Callable[..., Any]):
        self.module, self.eps, self.scale_in_fp32, self.own = module, eps, scale_in_fp32, own

    def __call__(self, x: torch.Tensor, *rest: Any, **named: Any) -> Any:
        weight: torch.Tensor = self.module.weight  # type: ignore[assignment]
        # More arguments (a gated norm's gate: Granite 4's and Nemotron-H's Mamba layers): the
        # module's own form, which the start-up check (one argument) did not compare.
        if rest or named or x.shape[-1] != weight.shape[0] or not _launchable(x, weight):
            return self.own(x, *rest, **named)
        return rms_norm(x, weight, self.eps, self.scale_in_fp32)


class _FusedMLP:
    """A gated MLP's forward (``down(silu(gate(x)) * up(x))``) with the SiLU·mul fused."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mlp: Any = self.module
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        if not _launchable(gate, up) or gate.shape != up.shape:
            return mlp.down_proj(mlp.act_fn(gate) * up)
        return mlp.down_proj(silu_mul(gate, up))


class _FusedRotary:
    """A modeling module's ``apply_rotary_pos_emb``: the kernel for ``[batch, heads, tokens, dim]``
    queries and keys with ``[batch, tokens, dim]`` angles, the module's own function otherwise."""

    def __init__(self, own: Callable[..., Any]):
        self.own = own

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *rest: Any, **named: Any
    ) -> Any:
        if rest or named or not self.takes(q, k, cos, sin):
            return self.own(q, k, cos, sin, *rest, **named)
        return rotary(q, cos, sin), rotary(k, cos, sin)

    @staticmethod
    def takes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
            return False
        batch, _, tokens, dim = q.shape
        return (
            dim % 2 == 0
            and k.shape[0] == batch
            and k.shape[2:] == q.shape[2:]
            and tuple(cos.shape) == (batch, tokens, dim)
            and _launchable(q, k, cos, sin)
        )


@dataclass
class FusedReport:
    """What :func:`fuse_model` swapped in (module counts) and the classes it left as they were."""

    norms: int = 0
    mlps: int = 0
    rotary: int = 0
    kept: list[str] = field(default_factory=list)
    failure: str | None = None

    def describe(self) -> str:
        parts = [
            f"{self.norms} RMSNorms",
            f"{self.mlps} gated MLPs (SiLU·mul)",
            f"rotary in {self.rotary} attention layers",
        ]
        kept = f"; kept as they are: {', '.join(sorted(set(self.kept)))}" if self.kept else ""
        return "fused kernels: " + ", ".join(parts) + kept


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _tolerance(dtype: torch.dtype) -> float:
    """Relative and absolute: float32 sums in another order; 16-bit types may round an ulp apart."""
    return 1e-5 if dtype == torch.float32 else 2e-2


def _agrees(fused: torch.Tensor, own: Any) -> bool:
    return (
        isinstance(own, torch.Tensor)
        and fused.shape == own.shape
        and fused.dtype == own.dtype
        and torch.allclose(fused, own, rtol=_tolerance(own.dtype), atol=_tolerance(own.dtype))
    )


def _own(function: Callable[..., Any], *args: torch.Tensor) -> Any:
    """What the model's own code returns for a check's input (None where it does not take it)."""
    try:
        return function(*args)
    except Exception:
        return None


def _norm_form(module: nn.Module) -> tuple[float, bool] | None:
    """(eps, scale_in_fp32) of the kernel form that computes what this RMSNorm computes, or None."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn((3, weight.shape[0]), generator=generator).to(weight.device, weight.dtype)
    if not _launchable(x, weight):
        return None
    own = _own(module, x)
    for scale_in_fp32 in (False, True):
        if _agrees(rms_norm(x, weight, eps, scale_in_fp32), own):
            return eps, scale_in_fp32
    return None


def _is_gated_silu_mlp(module: nn.Module, probe: torch.Tensor) -> bool:
    """A ``down(act(gate(x)) * up(x))`` module with a SiLU, checked on a random input of ``probe``'s
    device and dtype."""
    if not all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    if "silu" not in type(module.act_fn).__name__.lower():
        return False
    size = getattr(module.gate_proj, "in_features", None)
    if not isinstance(size, int):
        return False
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn((2, size), generator=generator).to(probe.device, probe.dtype)
    if not _launchable(x):
        return False
    return _agrees(_FusedMLP(module)(x), _own(module, x))


def _rotary_agrees(own: Callable[..., Any], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel computes what a modeling module's ``apply_rotary_pos_emb`` does (on
    queries laid out as attention modules make them: ``[batch, tokens, heads, dim]`` transposed)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn((2, 3, 4, 64), generator=generator).to(device, dtype).transpose(1, 2)
    k = torch.randn((2, 3, 2, 64), generator=generator).to(device, dtype).transpose(1, 2)
    angles = torch.rand((2, 3, 32), generator=generator) * 6.0
    cos = torch.cat([angles.cos()] * 2, -1).to(device, dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(device, dtype)
    if not _FusedRotary.takes(q, k, cos, sin):
        return False
    result = _own(own, q, k, cos, sin)
    if not isinstance(result, tuple) or len(result) != 2:
        return False
    own_q, own_k = result
    return _agrees(rotary(q, cos, sin), own_q) and _agrees(rotary(k, cos, sin), own_k)


def fuse_model(model: nn.Module) -> FusedReport:
    """Swaps the fused kernels into ``model``'s RMSNorms, gated MLPs and its attention modules'
    rotary, per class, where each class's check passes; a Triton failure leaves the model as it
    was (the report says why)."""
    report = FusedReport()
    # The device and dtype the checks' inputs take: the model's first float parameter (a quantized
    # layer holds buffers only, and a quantized attention or MLP module no parameter at all).
    probe = next((p for p in model.parameters() if p.dtype in _FLOATS), None)
    if probe is None:
        return report
    norm_forms: dict[type, tuple[float, bool] | None] = {}
    mlp_classes: dict[type, bool] = {}
    patched: dict[str, bool] = {}
    try:
        with torch.inference_mode():
            for module in model.modules():
                kind = type(module)
                if "RMSNorm" in kind.__name__:
                    if kind not in norm_forms:
                        norm_forms[kind] = _norm_form(module)
                    form = norm_forms[kind]
                    # A class's form fits its instances with a scale (Gemma 4's value norms have none).
                    if form is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
                        report.kept.append(kind.__name__)
                        continue
                    module.forward = _FusedNorm(module, form[0], form[1], module.forward)  # type: ignore[method-assign]
                    report.norms += 1
                elif hasattr(module, "gate_proj") and hasattr(module, "act_fn"):
                    if kind not in mlp_classes:
                        mlp_classes[kind] = _is_gated_silu_mlp(module, probe)
                    if not mlp_classes[kind]:
                        report.kept.append(kind.__name__)
                        continue
                    module.forward = _FusedMLP(module)  # type: ignore[method-assign]
                    report.mlps += 1
                elif kind.__name__.endswith("Attention") and hasattr(module, "q_proj"):
                    if _patch_rotary(kind, probe, patched):
                        report.rotary += 1
                    else:
                        report.kept.append(f"{kind.__name__} rotary")
    except Exception as error:  # triton cannot build or run them here: the model stays as it was
        unfuse_model(model)
        report = FusedReport(failure=f"{type(error).__name__}: {error}")
    return report


def _patch_rotary(kind: type, weight: torch.Tensor, patched: dict[str, bool]) -> bool:
    """Puts the kernel in front of ``kind``'s modeling module's ``apply_rotary_pos_emb`` (once per
    module, for every model of it in this process: the wrapper falls back to the function for
    anything but the tensors it takes)."""
    name = kind.__module__
    if name not in patched:
        module = sys.modules.get(name)
        own = getattr(module, "apply_rotary_pos_emb", None)
        if isinstance(own, _FusedRotary):
            patched[name] = True
        elif module is None or not callable(own):
            patched[name] = False
        else:
            patched[name] = _rotary_agrees(own, weight.device, weight.dtype)
            if patched[name]:
                module.__dict__["apply_rotary_pos_emb"] = _FusedRotary(own)
    return patched[name]


def unfuse_model(model: nn.Module) -> None:
    """Gives every module of ``model`` its own forward back (the rotary wrapper stays: it falls
    back by itself)."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), (_FusedNorm, _FusedMLP)):
            del module.__dict__["forward"]


# Logged when the kernels cannot run: what serving without them costs.
UNFUSED_COST = "the forward runs unfused (several kernels per RMSNorm, SiLU-mul and rotary: slower steps)"


def fuse_for_serving(model: nn.Module) -> bool:
    """:func:`fuse_model` at start-up: INFO with what was fused, ERROR with the reason and its cost
    when triton is missing or fails; whether anything was fused."""
    if not triton_available():
        log.error("triton is not installed: %s", UNFUSED_COST)
        return False
    report = fuse_model(model)
    if report.failure is not None:
        log.error("the fused kernels failed (%s): %s", report.failure, UNFUSED_COST)
        return False
    log.info("%s", report.describe())
    return report.norms + report.mlps + report.rotary > 0
