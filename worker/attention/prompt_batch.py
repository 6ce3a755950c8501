"""Whole prompts of a step attended together: padded at their ends to the longest of their group,
one causal SDPA per group instead of one gather and SDPA per prompt and layer.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.device.staging import staged


@dataclass(frozen=True)
class PromptGroup:
    """Prompts padded to ``longest`` tokens: ``gather`` [prompts * longest] is each padded
    position's flat token (a padding position repeats its prompt's last token); ``keep`` are the
    padded positions of the real tokens and ``tokens`` their flat indexes, in the same order."""

    prompts: int
    longest: int
    gather: torch.Tensor
    keep: torch.Tensor
    tokens: torch.Tensor


def group_prompts(chunks: Sequence[tuple[int, int]], device: torch.device) -> list[PromptGroup]:
    """Groups of ``(flat start, count)`` prompts, longest first, each padded to its longest with
    no more padding positions than real tokens."""
    ordered = sorted(chunks, key=lambda chunk: chunk[1], reverse=True)
    groups: list[list[tuple[int, int]]] = []
    for chunk in ordered:
        if groups:
            members = groups[-1]
            longest = members[0][1]
            real = sum(count for _, count in members) + chunk[1]
            if (len(members) + 1) * longest <= 2 * real:
                members.append(chunk)
                continue
        groups.append([chunk])
    return [_padded(members, device) for members in groups]


def _padded(members: list[tuple[int, int]], device: torch.device) -> PromptGroup:
    longest = members[0][1]
    gather: list[int] = []
    keep: list[int] = []
    tokens: list[int] = []
    for row, (start, count) in enumerate(members):
        gather += range(start, start + count)
        gather += [start + count - 1] * (longest - count)
        keep += range(row * longest, row * longest + count)
        tokens += range(start, start + count)
    values = staged(gather + keep + tokens, torch.long, device)  # one copy, not blocking the host
    padded, real = len(gather), len(keep)
    return PromptGroup(
        len(members), longest, values[:padded], values[padded : padded + real], values[padded + real :]
    )


def attend_prompts(
    group: PromptGroup,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Writes into ``out`` [T, heads, d] the causal attention of ``group``'s tokens, from the
    step's flat ``query`` [T, heads, d] and new ``key``/``value`` [T, kv_heads, d]."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key.shape[1]
    n, longest = group.prompts, group.longest

    def padded(flat: torch.Tensor, width: int) -> torch.Tensor:  # -> [n, width heads, longest, d]
        return flat.index_select(0, group.gather).view(n, longest, width, dim).transpose(1, 2)

    keys, values = padded(key, kv_heads), padded(value, kv_heads)
    if heads != kv_heads:  # 4-D and equal heads: CUDA's flash kernel takes them
        keys, values = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
    attended = F.scaled_dot_product_attention(padded(query, heads), keys, values, is_causal=True, scale=scale)
    flat = attended.transpose(1, 2).reshape(n * longest, heads, dim)
    out[group.tokens] = flat.index_select(0, group.keep).to(out.dtype)
