"""A mixture-of-experts block's experts and router on the int4/int8 weight-only kernels, for
batch-invariant steps (``--batch-invariant``): transformers' float expert and router products round
a token by how many tokens share its step.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from worker.quant.layers import Int4Linear, Int8Linear, QuantizedLinear, quantize_weight

# The flags transformers' ``use_experts_implementation`` decorator sets on an experts module.
_EXPERT_FLAGS = ("has_gate", "has_bias", "is_transposed")


def _expert_layers(
    weights: torch.Tensor, biases: torch.Tensor | None, transposed: bool, scheme: str
) -> torch.nn.ModuleList:
    """One quantized layer per expert from a ``[experts, out, in]`` (``[experts, in, out]`` when
    ``transposed``) float parameter."""
    layers: list[QuantizedLinear] = []
    with torch.no_grad():
        for e in range(weights.shape[0]):
            weight = weights[e].t() if transposed else weights[e]
            bias = None if biases is None else biases[e]
            layers.append(quantize_weight(scheme, weight, bias, batch_copy=False))
    return torch.nn.ModuleList(layers)


class RowInvariantExperts(torch.nn.Module):
    """An experts module (transformers' layout flags) whose products run on quantized layers.

    The original module stays as ``gating``, without its weights, for its own gate or activation
    (gpt-oss clamps and gates its own way) and its optional post-expert norm."""

    def __init__(self, experts: Any, scheme: str):
        super().__init__()
        self.has_gate = bool(experts.has_gate)
        self.post_norm = bool(getattr(experts, "has_post_expert_norm", False))
        transposed = bool(experts.is_transposed)
        first = "gate_up_proj" if self.has_gate else "up_proj"
        biases = bool(experts.has_bias)
        self.up = _expert_layers(
            getattr(experts, first), getattr(experts, f"{first}_bias") if biases else None, transposed, scheme
        )
        self.down = _expert_layers(
            experts.down_proj, experts.down_proj_bias if biases else None, transposed, scheme
        )
        for name in (first, "down_proj", f"{first}_bias", "down_proj_bias"):
            if name in experts._parameters:
                delattr(experts, name)
        self.gating: Any = experts

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden_states`` [T, H], the chosen experts and their weights [T, k] -> [T, H]."""
        tokens, k = top_k_index.shape
        chosen = top_k_index.reshape(-1)
        weights = top_k_weights.reshape(-1)
        out = hidden_states.new_empty((tokens * k, hidden_states.shape[-1]))
        for expert in chosen.unique().tolist():
            slots = (chosen == expert).nonzero()[:, 0]  # slot s is token s // k's (s % k)-th choice
            rows = self.up[expert](hidden_states[slots // k])
            rows = self.gating._apply_gate(rows) if self.has_gate else self.gating.act_fn(rows)
            rows = self.down[expert](rows)
            if self.post_norm:
                rows = self.gating.post_expert_norm(rows)
            out[slots] = (rows * weights[slots, None]).to(out.dtype)
        # A token's k products added in its choice order, one elementwise add at a time.
        per_token = out.view(tokens, k, -1)
        total = per_token[:, 0]
        for j in range(1, k):
            total = total + per_token[:, j]
        return total


_SIGMOIDS = (torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` by torch's exp, which computes every element by one routine;
    ``torch.sigmoid`` computes the elements of its vector part and those of its scalar tail by
    different exps, and which elements are in the tail follows the tensor's size (the step's
    tokens times the experts)."""
    return torch.exp(-x).add_(1).reciprocal_()


class _RouterOps(TorchFunctionMode):
    """While active, ``F.linear`` on ``weight`` runs ``layer`` (which holds the bias too) and a
    sigmoid runs :func:`_sigmoid`; any other ``F.linear`` raises, so no float product hides in the
    router's forward."""

    def __init__(self, weight: torch.Tensor, layer: torch.nn.Module):
        super().__init__()
        self.weight = weight
        self.layer = layer

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is not self.weight:
                raise RuntimeError("a router multiplies by a weight other than its own: not row-invariant")
            return self.layer(args[0] if args else kwargs["input"])
        if func in _SIGMOIDS and not kwargs:
            return _sigmoid(args[0])
        return func(*args, **kwargs)


class RowInvariantRouter(torch.nn.Module):
    """A router whose logits (``F.linear`` of its weight and bias) come from an int8 layer and whose
    sigmoid (GLM-4.5 scores by one) computes every element alike (:class:`_RouterOps`); its own
    forward does the rest (top-k, softmax, bias corrections). The float weight stays on the router
    as a plain tensor (not a parameter), only to recognise its ``F.linear``."""

    def __init__(self, router: Any):
        super().__init__()
        weight = router.weight.detach()
        bias = getattr(router, "bias", None)
        self.logits = Int8Linear.from_float(weight, None if bias is None else bias.detach(), batch_copy=False)
        del router.weight
        router.weight = weight
        self.router = router
        self._weight = weight

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _RouterOps(self._weight, self.logits):
            return self.router(*args, **kwargs)


def _is_experts(module: torch.nn.Module) -> bool:
    return all(hasattr(module, flag) for flag in _EXPERT_FLAGS) and isinstance(
        getattr(module, "down_proj", None), torch.nn.Parameter
    )


def _is_router(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        "Router" in type(module).__name__
        and isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 2
        and weight.is_floating_point()
    )


def model_scheme(model: torch.nn.Module) -> str | None:
    """The weight-only scheme of ``model``'s linear layers: int4 if any layer is int4, else int8
    if any is int8; None for a float model."""
    kinds = {type(m) for m in model.modules()}
    if Int4Linear in kinds:
        return "int4"
    return "int8" if Int8Linear in kinds else None


def row_invariant_moe(model: torch.nn.Module, scheme: str) -> int:
    """Replaces every MoE experts module of ``model`` by :class:`RowInvariantExperts` (``scheme``
    layers) and every router by :class:`RowInvariantRouter`; returns how many were replaced."""
    slots = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _is_experts(child) or _is_router(child)
    ]
    for parent, name, child in slots:
        replacement = RowInvariantExperts(child, scheme) if _is_experts(child) else RowInvariantRouter(child)
        setattr(parent, name, replacement)
    return len(slots)
