"""What sets one layer's attention apart from plain causal softmax (a sliding window, a logit
softcap, learned sink logits), read from the layer and its call, and the softmax that applies them.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerVariant:
    """``window``: a query sees itself and the ``window - 1`` keys before it (transformers'
    ``sliding_window``; None: every earlier key); ``softcap``: scores become ``c * tanh(s / c)``;
    ``sinks``: float32 ``[heads]`` logits added to each query head's softmax denominator only."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain_softmax(self) -> bool:
        """No softcap and no sinks: SDPA computes it (a window is only a mask)."""
        return self.softcap is None and self.sinks is None

    def window_within(self, keys: int) -> int | None:
        """The window where it hides some of ``keys`` keys; None where it covers them all."""
        return self.window if self.window is not None and self.window < keys else None


PLAIN = LayerVariant()


def layer_variant(module: torch.nn.Module, kwargs: dict[str, Any]) -> LayerVariant:
    """The variant transformers asks of this call: ``sliding_window`` (Mistral and Phi-3 pass it
    from the config, the others from the layer, None on their global layers), ``softcap`` (Gemma 2)
    and ``s_aux`` (gpt-oss's sinks)."""
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if window is None and softcap is None and sinks is None:
        return PLAIN
    return LayerVariant(
        int(window) if window else None,
        float(softcap) if softcap else None,
        sinks.detach().float() if sinks is not None else None,
    )


def window_mask(queries: torch.Tensor, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Bool ``[len(queries), keys]``: key ``k`` is visible to a query at position ``q`` when
    ``k <= q`` and, with a window, ``k > q - window``."""
    position = torch.arange(keys, device=device)[None, :]
    visible = position <= queries[:, None]
    if window is not None:
        visible &= position > queries[:, None] - window
    return visible


def softmax_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    variant: LayerVariant,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``softmax(cap(q k^T * scale) | visible) v`` with the sink logits in the denominator, in
    float32, for what SDPA cannot do. ``query`` [..., Q, d], ``keys``/``values`` [..., K, d],
    ``visible`` bool broadcast to [..., Q, K]; ``sinks`` (None without) broadcast to [..., Q, 1]."""
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale
    if variant.softcap is not None:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        # exp(s_i) / (sum exp(s) + exp(sink)) = softmax_i * sigmoid(logsumexp(s) - sink)
        probs = probs * torch.sigmoid(torch.logsumexp(scores, dim=-1, keepdim=True) - sinks)
    return torch.matmul(probs, values.float()).to(query.dtype)


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    variant: LayerVariant,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One attention over gathered keys: SDPA for a plain softmax (``visible`` None: causal over
    the whole row), else :func:`softmax_attention`. Shapes as there."""
    if variant.plain_softmax:
        if visible is None:
            return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale)
    if visible is None:
        count = query.shape[-2]
        visible = window_mask(torch.arange(count, device=query.device), keys.shape[-2], None, query.device)
    return softmax_attention(query, keys, values, visible, scale, variant, sinks)
