"""A PEFT LoRA adapter folder read and checked against the model's wrapped projections.

Design notes: docs/worker.md ("LoRA adapters").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.errors import InvalidRequest

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
# PEFT features that change what a LoRA computes, which these layers do not compute: refused.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "layers_to_transform": "layers_to_transform",
}


class AdapterError(InvalidRequest):
    """An adapter that cannot be served here; the message names the problem."""

    def __init__(self, message: str):
        super().__init__(message, param="lora_path")


@dataclass(frozen=True)
class LoraWeights:
    """One loaded adapter: per wrapped module (the model's own module path), ``A [r, in]`` and
    ``B [out, r]`` with the adapter's scale already folded into ``B``; on the CPU."""

    path: str
    rank: int
    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def _read_config(folder: Path) -> dict[str, object]:
    if not folder.is_dir():
        raise AdapterError(f"LoRA adapter folder {str(folder)!r} does not exist or is not a folder")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"LoRA adapter folder {str(folder)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{config_path} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{config_path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"{config_path}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{config_path}: bias {config.get('bias')!r} is not supported (only 'none')")
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path), device="cpu")
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise AdapterError(f"{path} cannot be read: {exc}") from exc
        if not isinstance(loaded, dict):
            raise AdapterError(f"{path} holds no tensors by name")
        return loaded
    raise AdapterError(f"LoRA adapter folder {str(folder)!r} has no {' or '.join(WEIGHT_FILES)}")


def _pairs(tensors: Mapping[str, torch.Tensor], folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Module path -> {"A": ..., "B": ...}, from PEFT's saved names."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PREFIX)
        for part, letter in ((".lora_A.weight", "A"), (".lora_B.weight", "B")):
            if name.endswith(part):
                pairs.setdefault(name.removesuffix(part), {})[letter] = tensor
                break
        else:
            if "lora_embedding" in name or name.endswith(".weight"):
                raise AdapterError(f"{folder}: tensor {key!r} is not a LoRA A/B pair of a linear layer")
    if not pairs:
        raise AdapterError(f"{folder}: the weights hold no lora_A/lora_B tensors")
    return pairs


def read_adapter(
    path: str, targets: Mapping[str, tuple[int, int]], max_rank: int, dtype: torch.dtype
) -> LoraWeights:
    """Reads a PEFT LoRA folder; ``targets``: the model's wrapped modules and their ``(in, out)``.
    Raises :class:`AdapterError` for a bad folder, a rank above ``max_rank``, a target module the
    model lacks (or does not wrap) and weights shaped for another base model."""
    folder = Path(path)
    config = _read_config(folder)
    pairs = _pairs(_read_tensors(folder), folder)
    rank = config.get("r", 0)
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{folder / CONFIG_FILE}: r must be a positive rank, got {config.get('r')!r}")
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {str(folder)!r} has rank {rank}, above --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha") or rank
    if not isinstance(alpha, int | float):
        raise AdapterError(f"{folder / CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, pair in sorted(pairs.items()):
        modules[name] = _checked_pair(name, pair, targets, rank, folder)
        a, b = modules[name]
        modules[name] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
    return LoraWeights(str(folder), rank, modules)


def _checked_pair(
    name: str,
    pair: Mapping[str, torch.Tensor],
    targets: Mapping[str, tuple[int, int]],
    rank: int,
    folder: Path,
) -> tuple[torch.Tensor, torch.Tensor]:
    if name not in targets:
        leaves = sorted({target.rsplit(".", 1)[-1] for target in targets})
        raise AdapterError(
            f"LoRA adapter {str(folder)!r} targets module {name!r}, which the model lacks "
            f"(served target modules: {', '.join(leaves)})"
        )
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{folder}: module {name!r} lacks its lora_A or lora_B weight")
    a, b = pair["A"], pair["B"]
    fan_in, fan_out = targets[name]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(
            f"{folder}: module {name!r} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
            f"not of rank {rank}"
        )
    if a.shape[1] != fan_in or b.shape[0] != fan_out:
        raise AdapterError(
            f"LoRA adapter {str(folder)!r} was trained for another base model: module {name!r} "
            f"maps {a.shape[1]} -> {b.shape[0]} features, the served model's {fan_in} -> {fan_out}"
        )
    return a, b
