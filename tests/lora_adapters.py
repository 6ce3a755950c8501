"""Random PEFT LoRA adapters over a tiny base model, and peft's merged model as their reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(
    base_dir: Path,
    folder: Path,
    *,
    seed: int,
    rank: int = 8,
    targets: tuple[str, ...] = ALL_TARGETS,
    alpha: int = 16,
) -> Path:
    """Saves a random LoRA adapter of ``base_dir`` (non-zero ``lora_B``, large enough to change
    greedy tokens) as a PEFT folder in ``folder``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False)
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return folder


def merged_model(base_dir: Path, adapter_dir: Path | None, dequantized: dict[str, Any] | None = None) -> Any:
    """peft's merged model of ``adapter_dir`` over ``base_dir`` (the base alone for None), in
    float32 on the CPU; ``dequantized``: module path -> float weight replacing the base's (an int4
    base's own weights, read back)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in (dequantized or {}).items():
            base.get_submodule(name).weight.copy_(weight)
    if adapter_dir is None:
        return base.eval()
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def greedy_tokens(model: Any, prompt: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens of transformers' own ``generate``."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def prompt_logprobs(model: Any, prompt: list[int]) -> list[float]:
    """Each prompt token's logprob after the first, given the tokens before it."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    chosen = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return chosen.tolist()
