"""Pre-quantized checkpoints of one tiny random Llama made by the real tools, each with transformers'
forward of it (which dequantizes) as the reference: ``make fixtures`` runs it with compressed-tensors
(installed ``--no-deps`` into its own folder) on ``PYTHONPATH``; GPTQ and AWQ where gptqmodel imports;
block FP8 and a tiny gpt-oss's MXFP4 experts by small writers (no packer runs offline on the CPU).
Idempotent; each checkpoint's folder holds ``reference.json``. Notes: docs/testing.md."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tools.fixtures import DEFAULT_DIR

ROOT = DEFAULT_DIR / "quantized"
VOCAB = 128  # tests/tiny_families.py's COMMON; the tokenizer below names each id
PROMPT = [5, 17, 42, 99, 3, 64, 127, 8, 31, 77, 12, 100, 55, 2, 90, 61]
NEW_TOKENS = 24
GROUP = 32


def tiny_float(folder: Path) -> Path:
    """The float checkpoint every format is made from: tests/tiny_families.py's llama (its output
    layer untied, so the checkpoint holds the layers a tool leaves in float) and a word-level
    tokenizer naming its 128 ids (``t0``..``t127``; a byte-level decoder, as grammars want one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_families import tiny_config, tiny_model

    # transformers' usual initializer_range (tiny_families' 0.2 sharpens attention for its own tests, and
    # its logits of ~10 make every rounding difference between two forwards ten times larger).
    ids = {"bos_token_id": 1, "eos_token_id": 0}
    config = tiny_config("llama", vocab_size=VOCAB, tie_word_embeddings=False, initializer_range=0.02, **ids)
    config.architectures = ["LlamaForCausalLM"]
    tiny_model(config).save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.ByteLevel()  # its ids' names are ASCII: each decodes to itself
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="t0", bos_token="t1", unk_token="t0")
    tokenizer.save_pretrained(folder)
    return folder


def _calibrate(model: torch.nn.Module) -> None:
    """Weight-only schemes need no data: each weight's own min and max give its scales, as
    llm-compressor's min-max observer would."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        weight = module.weight.data
        if args.strategy == "group":
            weight = weight.reshape(weight.shape[0], -1, args.group_size)
            low, high = weight.amin(-1), weight.amax(-1)
        elif args.strategy == "block":
            rows, columns = args.block_structure
            tiles = weight.reshape(weight.shape[0] // rows, rows, weight.shape[1] // columns, columns)
            low, high = tiles.amin((1, 3)), tiles.amax((1, 3))
        else:
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        scale, zero = calculate_qparams(low, high, args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
            module.weight_zero_point.shape
        )


def compressed(source: Path, target: Path, preset: str, layout: str) -> None:
    """``source`` quantized with compressed-tensors' ``preset`` and saved in ``layout``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import AutoModelForCausalLM

    # In bfloat16, as released checkpoints are: the scales are bfloat16 numbers, as the CPU kernels take them.
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights is not None and scheme.weights.group_size:
        scheme.weights.group_size = GROUP
    if scheme.weights is not None and scheme.weights.block_structure:  # FP8_BLOCK: 128 x 128 tiles
        scheme.weights.block_structure = list(FP8_BLOCK)
        if scheme.input_activations is not None and scheme.input_activations.group_size:
            scheme.input_activations.group_size = FP8_BLOCK[1]
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    _calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=layout)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(str(target))


def gptq(source: Path, target: Path, *, desc_act: bool = False, awq: bool = False) -> None:
    """``source`` quantized by gptqmodel on the CPU (4 bits, groups of 32) from a handful of calibration
    prompts: GPTQ (``desc_act``: act-order, its ``g_idx`` reordering the groups) or, with ``awq``,
    AWQ in AutoAWQ's GEMM layout with zero points (``quant_method: awq``)."""
    from gptqmodel import GPTQModel, QuantizeConfig

    config: Any
    if awq:
        from gptqmodel.looper.awq_processor import AWQProcessor
        from gptqmodel.quantization.config import AWQConfig

        # Its clipping search batches 64 output rows at a time (the tiny model's k/v layers have 32),
        # so it is skipped: the scale search, the quantization and the packing are still the tool's.
        AWQProcessor._search_best_clip = lambda self, *args: []  # type: ignore[method-assign]
        config = AWQConfig(bits=4, group_size=GROUP, sym=False)
    else:
        config = QuantizeConfig(bits=4, group_size=GROUP, desc_act=desc_act, sym=True)
    model = GPTQModel.load(str(source), config, device="cpu")
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(2, VOCAB, (1, 32), generator=generator)} for _ in range(8)]
    samples = [{**s, "attention_mask": torch.ones_like(s["input_ids"])} for s in samples]
    model.quantize(samples, batch_size=1)
    model.save(str(target))


def _dequantizing(folder: Path) -> dict[str, Any]:
    """transformers' options for a checkpoint it cannot run compressed: 5.24 sizes an asymmetric
    pack-quantized layer's zero points unpacked and refuses the packed ones, so that checkpoint is
    decompressed on load by compressed-tensors' own decompressor (``dequantize=True``); MXFP4 is
    dequantized on load by transformers' own ``Mxfp4Config(dequantize=True)``."""
    quantization = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    if quantization.get("quant_method") == "mxfp4":  # its CPU path wants the kernels package
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    groups = quantization.get("config_groups") or {}
    if not any(group.get("weights", {}).get("symmetric") is False for group in groups.values()):
        return {}
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


FP8_BLOCK = [32, 32]  # the releases use 128 x 128; the tiny model's layers are 64 wide


@torch.no_grad()
def fp8_blocks(source: Path, target: Path) -> None:
    """``source`` written as transformers' fine-grained FP8 (``quant_method: fp8``, the Qwen3-FP8
    releases' layout; no packer installs offline on the CPU): each linear layer but ``lm_head`` as an
    e4m3 ``weight`` and a float32 ``weight_scale_inv`` per 32 x 32 block, ``max|block| / 448``."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(target)
    tensors = load_file(str(target / "model.safetensors"))
    rows, columns = FP8_BLOCK
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        weight = tensors[name].float()
        out_features, in_features = weight.shape
        tiles = weight.reshape(out_features // rows, rows, in_features // columns, columns)
        scale = (tiles.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
        tiles = tiles / scale[:, None, :, None]
        tensors[name] = tiles.reshape(weight.shape).to(torch.float8_e4m3fn)
        tensors[f"{name}_scale_inv"] = scale
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": FP8_BLOCK,
        "modules_to_not_convert": ["lm_head"],
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))


E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0..7; bit 3 is the sign


def mxfp4_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [..., n] in MXFP4 as the OCP Microscaling spec (v1.0) defines it and gpt-oss stores it:
    per 32 values an e8m0 scale byte ``s`` (``2 ** (s - 127)``, the block's ``floor(log2(max|x|)) - 2``,
    e2m1's largest exponent being 2) and each value divided by it, rounded to the nearest e2m1 value
    (ties to the smaller magnitude; beyond 6 clamped to 6), as a 4-bit code, two a byte, the even
    element in the low nibble: blocks uint8 [..., n / 32, 16], scales uint8 [..., n / 32]."""
    blocks = weight.float().reshape(*weight.shape[:-1], -1, 32)
    largest = blocks.abs().amax(-1).clamp(min=2.0**-127)
    exponent = (torch.floor(torch.log2(largest)) - 2).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(-1) | ((scaled < 0).long() << 3)
    pairs = codes.reshape(*codes.shape[:-1], 16, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8), (exponent + 127).to(torch.uint8)


def tiny_gpt_oss() -> Any:
    """tests/tiny_families.py's gpt-oss (4 experts, 2 chosen, sinks, alternating windows), with the
    vocabulary and special ids of :func:`tiny_float`'s tokenizer, its output layer untied and weights
    of standard deviation 0.05 (the first near-tie of its greedy tokens comes at step 21)."""
    from tests.tiny_families import tiny_config, tiny_model

    ids = {"bos_token_id": 1, "eos_token_id": 0, "pad_token_id": 0}
    config = tiny_config(
        "gpt_oss", vocab_size=VOCAB, tie_word_embeddings=False, initializer_range=0.05, **ids
    )
    config.architectures = ["GptOssForCausalLM"]
    return tiny_model(config)


# gpt-oss's own quantization_config: everything but the experts stays bfloat16.
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


@torch.no_grad()
def mxfp4(source: Path, target: Path) -> None:
    """A tiny random gpt-oss written as gpt-oss's releases are (``quant_method: mxfp4``): each experts
    module's ``gate_up_proj`` and ``down_proj`` ([E, in, out] in the model) as ``*_blocks`` and
    ``*_scales`` of the [E, out, in] weight (:func:`mxfp4_pack`); the rest in bfloat16. ``source``
    (the Llama) only lends its tokenizer (copied by :func:`make`)."""
    from safetensors.torch import load_file, save_file

    tiny_gpt_oss().to(torch.bfloat16).save_pretrained(target)
    tensors = load_file(str(target / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_pack(tensors.pop(name).float().transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (target / "config.json").write_text(json.dumps(config, indent=2))


@torch.no_grad()
def reference(folder: Path) -> dict[str, Any]:
    """transformers' forward of the checkpoint: the prompt's logprobs, 24 greedy tokens and at each
    the margin between the two best logits (near-ties may flip under other rounding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **_dequantizing(folder)).eval()
    ids = torch.tensor([PROMPT])
    logprobs = model(ids).logits.float().log_softmax(-1)[0]
    prompt_logprobs = [logprobs[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    tokens, margins = [], []
    for _ in range(NEW_TOKENS):
        last = model(ids).logits[0, -1].float()
        top = last.topk(2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
    return {"prompt": PROMPT, "prompt_logprobs": prompt_logprobs, "tokens": tokens, "margins": margins}


def make(name: str, build: Callable[[Path, Path], None], source: Path, root: Path) -> Path | None:
    """``root/name``: the checkpoint, its tokenizer and ``reference.json`` (made once, atomically)."""
    target = root / name
    if (target / "reference.json").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build(source, staging)
        for extra in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (source / extra).is_file() and not (staging / extra).is_file():
                shutil.copy(source / extra, staging / extra)
        (staging / "reference.json").write_text(json.dumps(reference(staging)))
        staging.rename(target)
    except ImportError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        print(f"{name}: not made ({exc})", file=sys.stderr)
        return None
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=ROOT)
    root = parser.parse_args().dir
    root.mkdir(parents=True, exist_ok=True)
    source = root / "float"
    if not (source / "config.json").is_file():
        tiny_float(Path(tempfile.mkdtemp(prefix=".float-", dir=root))).rename(source)
    for name, build in [
        ("fp8_dynamic", lambda s, t: compressed(s, t, "FP8_DYNAMIC", "float-quantized")),
        ("w4a16", lambda s, t: compressed(s, t, "W4A16", "pack-quantized")),
        ("gptq", gptq),
        ("w4a16_asym", lambda s, t: compressed(s, t, "W4A16_ASYM", "pack-quantized")),
        ("awq", lambda s, t: gptq(s, t, awq=True)),
        ("gptq_act_order", lambda s, t: gptq(s, t, desc_act=True)),
        ("fp8_block", fp8_blocks),
        ("fp8_block_ct", lambda s, t: compressed(s, t, "FP8_BLOCK", "float-quantized")),
        ("mxfp4", mxfp4),
    ]:
        print(name, make(name, build, source, root))


if __name__ == "__main__":
    main()
