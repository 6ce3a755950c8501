"""Linear layers with their weights packed once for oneDNN, for CPU inference.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# Largest relative difference from nn.Linear accepted by the check of the first packed layer.
_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


class PackedLinear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` in oneDNN's blocked layout (inference only)."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # Not registered as buffers: a oneDNN tensor has no storage that state_dict or .to() could use.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn packed"


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether this torch build can pack linear weights of ``dtype`` for this CPU."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


# Modules whose own forward reads a child projection's ``weight``: a MultiheadAttention (a SigLIP
# vision tower's pooling head) and Gemma 4's patch embedder (its dtype).
READS_WEIGHTS = frozenset({"MultiheadAttention", "Gemma4VisionPatchEmbedder"})


def pack_linears(model: torch.nn.Module, *, batch_hint: int) -> int:
    """Replaces every ``nn.Linear`` of a CPU ``model`` by a :class:`PackedLinear`; returns how many.

    ``batch_hint`` is the usual number of rows per call (the decode batch); any row count works.
    Returns 0, leaving the model unchanged, where packing is unsupported or gives a wrong result.
    """
    # (parent, attribute) pairs only: holding the layers themselves would keep every original
    # weight alive until the end, doubling the weights' memory while packing. Modules that read
    # their projections' weights themselves keep them (:data:`READS_WEIGHTS`).
    slots = [
        (parent, name)
        for parent in model.modules()
        if type(parent).__name__ not in READS_WEIGHTS
        for name, child in parent.named_children()
        if isinstance(child, torch.nn.Linear) and child.weight.device.type == "cpu"
    ]
    hint = max(1, batch_hint)
    packed = 0
    # One layer at a time, so each original weight is freed as soon as its packed copy replaces it
    # (a tied one, such as an output layer sharing the embedding's weight, stays with the embedding).
    for parent, name in slots:
        layer = getattr(parent, name)
        if not packing_supported(layer.weight.dtype):
            continue
        # The first packed layer is checked: it vouches for the kernels.
        replacement = PackedLinear(layer, hint) if packed else _checked_pack(layer, hint)
        if replacement is None:
            return 0
        setattr(parent, name, replacement)
        packed += 1
    return packed


@torch.no_grad()  # not inference_mode: the packed weight it returns must be an ordinary tensor
def _checked_pack(linear: torch.nn.Linear, batch_hint: int) -> PackedLinear | None:
    """A packed copy of ``linear``, or None (logged) where it does not compute what ``linear`` does
    up to summation order, or cannot be made."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, linear.in_features, generator=generator).to(linear.weight.dtype)
    try:
        packed = PackedLinear(linear, batch_hint)
        want, got = linear(x).float(), packed(x).float()
    except RuntimeError as exc:
        log.warning("oneDNN weight packing unavailable (%s); using torch's default linear kernels", exc)
        return None
    error = float((want - got).abs().max()) / (float(want.abs().max()) or 1.0)
    if not error <= _TOLERANCE[linear.weight.dtype]:
        log.warning(
            "oneDNN packed output differs from nn.Linear by %.2e (relative); using torch's kernels", error
        )
        return None
    return packed
