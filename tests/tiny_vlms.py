"""Tiny random-weight vision-language models saved as Hugging Face folders with their processors
(configs written here, tokenizers from the families fixtures), for the worker's and edge's tests."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoTokenizer

from tools.fixtures import DEFAULT_DIR, fetch_tokenizer
from worker.model.loader import load_processor

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "templates"  # the families' real templates

# A cached checkpoint of another key (older sources or versions) unused this long is removed.
STALE_AFTER_S = 24 * 3600
ARCHITECTURES = ("llava", "gemma3", "idefics3", "qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe", "gemma4")
TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "initializer_range": 0.2,
}
VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}
# A plain template that renders list content with image parts as the processor's image token.
# What every tiny processor shares: resize, rescale and normalise to [-1, 1], RGB.
IMAGE_DEFAULTS: dict[str, Any] = {
    "do_resize": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_convert_rgb": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
LLAVA_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _fixture(family: str) -> Path:
    """The family's real tokenizer (``make fixtures``; fetched once if missing)."""
    return fetch_tokenizer(family, DEFAULT_DIR)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=1))


def _save(model: Any, folder: Path, processor_files: dict[str, dict[str, Any]], tokenizer: Any) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for name, value in processor_files.items():
        _write_json(folder / name, value)


def _llava(folder: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(_fixture("qwen3"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = LLAVA_TEMPLATE
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION, projection_dim=32),
        text_config=transformers.Qwen2Config(**TEXT, vocab_size=len(tokenizer)),
        image_token_id=image_token,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    model = transformers.LlavaForConditionalGeneration(config)
    _save(
        model,
        folder,
        {
            "preprocessor_config.json": {
                "image_processor_type": "CLIPImageProcessor",
                "processor_class": "LlavaProcessor",
                "size": {"shortest_edge": VISION["image_size"]},
                "crop_size": {"height": VISION["image_size"], "width": VISION["image_size"]},
                "do_center_crop": True,
                **IMAGE_DEFAULTS,
                "resample": 3,
            },
            "processor_config.json": {
                "processor_class": "LlavaProcessor",
                "patch_size": VISION["patch_size"],
                "vision_feature_select_strategy": "default",
                "image_token": "<image>",
                "num_additional_image_tokens": 1,
            },
        },
        tokenizer,
    )


def _gemma3(folder: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(_fixture("gemma3"))
    image_token = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    tokens_per_image = 4
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(
            # The default initializer: with TEXT's, this tiny Gemma writes one token whatever it sees.
            **{**TEXT, "num_hidden_layers": 3, "initializer_range": 0.02},
            vocab_size=len(tokenizer),
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        ),
        vision_config=transformers.SiglipVisionConfig(**VISION),
        mm_tokens_per_image=tokens_per_image,
        image_token_id=image_token,
        boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
    )
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # the projector starts at zero: an image would change nothing
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    _save(
        model,
        folder,
        {
            "preprocessor_config.json": {
                "image_processor_type": "Gemma3ImageProcessor",
                "processor_class": "Gemma3Processor",
                "size": {"height": VISION["image_size"], "width": VISION["image_size"]},
                **IMAGE_DEFAULTS,
                "do_pan_and_scan": False,
                "resample": 2,
            },
            "processor_config.json": {
                "processor_class": "Gemma3Processor",
                "image_seq_length": tokens_per_image,
            },
        },
        tokenizer,
    )


def _idefics3(folder: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(_fixture("qwen3"))
    tiles = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    special = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *tiles]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = LLAVA_TEMPLATE
    tokens_per_tile = (VISION["image_size"] // VISION["patch_size"]) ** 2 // 4  # scale factor 2
    config = transformers.Idefics3Config(
        text_config={**TEXT, "model_type": "llama", "vocab_size": len(tokenizer)},
        vision_config=VISION,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    model = transformers.Idefics3ForConditionalGeneration(config)
    _save(
        model,
        folder,
        {
            "preprocessor_config.json": {
                "image_processor_type": "Idefics3ImageProcessor",
                "processor_class": "Idefics3Processor",
                # An image is resized to at most 64 pixels a side and split into 32-pixel tiles plus
                # the whole image at 32: a 40x30 image is 2x2 tiles and a global one.
                "size": {"longest_edge": 2 * VISION["image_size"]},
                "max_image_size": {"longest_edge": VISION["image_size"]},
                "do_image_splitting": True,
                **IMAGE_DEFAULTS,
                "do_pad": True,
                "resample": 1,
            },
            "processor_config.json": {
                "processor_class": "Idefics3Processor",
                "image_seq_len": tokens_per_tile,
            },
        },
        tokenizer,
    )


QWEN2_VL_TEMPLATE = LLAVA_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")


QWEN_VISION: dict[str, Any] = {"depth": 2, "num_heads": 2, "patch_size": 4, "spatial_merge_size": 2}
QWEN_VISION_BY_ARCH: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"embed_dim": 32, "hidden_size": TEXT["hidden_size"], "mlp_ratio": 1},
    # Windows of 2x2 merged tokens in the first block, full attention in the second.
    "qwen2_5_vl": {
        "hidden_size": 32,
        "intermediate_size": 32,
        "out_hidden_size": TEXT["hidden_size"],
        "window_size": 16,
        "fullatt_block_indexes": [1],
    },
}


def _qwen_vl(folder: Path, arch: str = "qwen2_vl") -> None:
    tokenizer = AutoTokenizer.from_pretrained(_fixture("qwen3"))
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    text = {
        **TEXT,
        "vocab_size": len(tokenizer),
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    }
    qwen2 = arch == "qwen2_vl"
    config_class = transformers.Qwen2VLConfig if qwen2 else transformers.Qwen2_5_VLConfig
    model_class = (
        transformers.Qwen2VLForConditionalGeneration
        if qwen2
        else transformers.Qwen2_5_VLForConditionalGeneration
    )
    processor_class = "Qwen2VLProcessor" if qwen2 else "Qwen2_5_VLProcessor"
    config = config_class(
        text_config=text,
        vision_config={**QWEN_VISION, **QWEN_VISION_BY_ARCH[arch]},
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    model = model_class(config)
    _save(
        model,
        folder,
        {
            "preprocessor_config.json": {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": processor_class,
                "patch_size": 4,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32},
                **IMAGE_DEFAULTS,
            },
            "processor_config.json": {"processor_class": processor_class},
        },
        tokenizer,
    )


# The multimodal checkpoints of the hybrid and Gemma 4 tiny families: their language models beside
# a tiny vision tower.
MULTIMODAL_HYBRIDS = ("qwen3_5", "qwen3_5_moe", "gemma4")
QWEN3_5_VISION: dict[str, Any] = {
    **{key: QWEN_VISION[key] for key in ("depth", "num_heads", "patch_size", "spatial_merge_size")},
    "hidden_size": 32,
    "intermediate_size": 32,
    "out_hidden_size": TEXT["hidden_size"],
    "num_position_embeddings": 16,
}


def _multimodal_config(arch: str, tokenizer: Any) -> Any:
    """The multimodal config of ``arch``: the tiny family's text config with the tokenizer's vocabulary."""
    from tests.tiny_families import tiny_config

    vocab = {"vocab_size": len(tokenizer), "tie_word_embeddings": True}
    if arch == "gemma4":
        text = tiny_config("gemma4_text", **vocab, vocab_size_per_layer_input=len(tokenizer))
        vision = {**VISION, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4}
        del vision["image_size"]
        return transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision, audio_config=None)
    text = tiny_config(f"{arch}_text", **vocab).to_dict()
    config_class = transformers.Qwen3_5Config if arch == "qwen3_5" else transformers.Qwen3_5MoeConfig
    tokens = {
        "image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    }
    return config_class(text_config=text, vision_config=QWEN3_5_VISION, tie_word_embeddings=True, **tokens)


def _qwen3_5(folder: Path, arch: str = "qwen3_5") -> None:
    """Qwen3.5 (or its MoE): the hybrid tiny family's language model beside a tiny vision tower,
    with Qwen3-VL's processor (Qwen2-VL's image processor) as the released checkpoints have it."""
    tokenizer = AutoTokenizer.from_pretrained(_fixture("qwen3"))
    tokenizer.chat_template = (TEMPLATES / "Qwen3.5-4B.jinja").read_text()
    model = transformers.AutoModelForImageTextToText.from_config(_multimodal_config(arch, tokenizer))
    model.config.architectures = [type(model).__name__]
    with torch.no_grad():  # a merger this small and this random makes every image look alike
        for parameter in model.model.visual.merger.parameters():
            torch.nn.init.normal_(parameter, std=0.5)
    _save(
        model,
        folder,
        {
            "preprocessor_config.json": {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen3VLProcessor",
                "patch_size": QWEN3_5_VISION["patch_size"],
                "merge_size": QWEN3_5_VISION["spatial_merge_size"],
                "temporal_patch_size": 2,
                "size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32},
                **IMAGE_DEFAULTS,
            },
            "processor_config.json": {"processor_class": "Qwen3VLProcessor"},
        },
        tokenizer,
    )


# Gemma 4's own image and audio markers (its template writes ``<|image|>``), added to Gemma 3's
# tokenizer (no Gemma 4 tokenizer is on the registries) under the names its processor reads.
GEMMA4_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "video_token": "<|video|>",
}


def _gemma4(folder: Path) -> None:
    """Gemma 4: the tiny ``gemma4_text`` family (KV-sharing layers, per-layer embeddings) beside a
    tiny variable-resolution vision tower, with its own template and processor (no audio tower)."""
    tokenizer = AutoTokenizer.from_pretrained(_fixture("gemma3"), extra_special_tokens=GEMMA4_TOKENS)
    tokenizer.chat_template = (TEMPLATES / "google-gemma-4-31B-it.jinja").read_text()
    config = _multimodal_config("gemma4", tokenizer)
    config.text_config.use_bidirectional_attention = "vision"  # as the larger checkpoints have it
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA4_TOKENS.items()}
    config.image_token_id, config.boi_token_id, config.eoi_token_id = (
        ids["image_token"],
        ids["boi_token"],
        ids["eoi_token"],
    )
    config.audio_token_id, config.boa_token_id = ids["audio_token"], ids["boa_token"]
    config.eoa_token_index, config.video_token_id = ids["eoa_token"], ids["video_token"]
    model = transformers.AutoModelForImageTextToText.from_config(config)
    model.config.architectures = [type(model).__name__]
    with torch.no_grad():  # the tiny tower's features are small beside the text embeddings
        torch.nn.init.normal_(model.model.embed_vision.embedding_projection.weight, std=2.0)
    _save(
        model,
        folder,
        {
            "preprocessor_config.json": {
                "image_processor_type": "Gemma4ImageProcessor",
                "processor_class": "Gemma4Processor",
                "patch_size": 4,
                "max_soft_tokens": 70,  # the smallest it takes
                "pooling_kernel_size": 3,
                "do_resize": True,
                "do_rescale": True,
                "do_normalize": False,
                "do_convert_rgb": True,
            },
            "processor_config.json": {"processor_class": "Gemma4Processor", "image_seq_length": 70},
        },
        tokenizer,
    )


BUILDERS: dict[str, Callable[[Path], None]] = {
    "llava": _llava,
    "gemma3": _gemma3,
    "idefics3": _idefics3,
    "qwen2_vl": _qwen_vl,
    "qwen2_5_vl": lambda folder: _qwen_vl(folder, "qwen2_5_vl"),
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": lambda folder: _qwen3_5(folder, "qwen3_5_moe"),
    "gemma4": _gemma4,
}


_PROCESSORS: dict[str, Any] = {}


def tiny_processor(folder: Path) -> Any:
    """The processor of a tiny model's ``folder``, loaded once per process: loading it reads the
    family's large vocabulary again (seconds for Gemma's), and the tests only read it."""
    key = str(folder)
    if key not in _PROCESSORS:
        _PROCESSORS[key] = load_processor(key)
    return _PROCESSORS[key]


def cache_key(arch: str) -> str:
    """What a tiny checkpoint of ``arch`` is made of: this module's and tests/tiny_families.py's
    sources, the templates, the fixture tokenizers' files (name, size, modification time), the
    architecture, and the torch, transformers and tokenizers versions."""
    import tokenizers

    digest = hashlib.sha256(
        f"{arch} {torch.__version__} {transformers.__version__} {tokenizers.__version__}".encode()
    )
    here = Path(__file__).resolve().parent
    for path in [here / "tiny_vlms.py", here / "tiny_families.py", *sorted(TEMPLATES.iterdir())]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for family in ("qwen3", "gemma3"):
        for path in sorted(_fixture(family).iterdir()):
            stat = path.stat()
            digest.update(f"{family}/{path.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def cached_tiny_vlm(arch: str, cache: Path) -> Path:
    """The tiny checkpoint of ``arch`` under ``cache`` (the tests' ``~/.cache/sluice/tiny-vlms``),
    built by the first run that needs it while other processes wait on a lock, and read by every
    later run as long as :func:`cache_key` is the same: a build parses the family's real tokenizer
    twice and saves it (Gemma 3's and Gemma 4's 8 CPU-s each, the eight 33)."""
    from filelock import FileLock

    cache.mkdir(parents=True, exist_ok=True)
    folder = cache / f"{arch}-{cache_key(arch)}"
    done = cache / f"{folder.name}.done"
    with FileLock(str(cache / f"{arch}.lock")):
        if not done.exists() or not (folder / "config.json").is_file():
            done.unlink(missing_ok=True)
            build_tiny_vlm(arch, folder)  # an unfinished folder (an interrupted build) is built again
        done.touch()  # its last use
        for other in cache.glob(f"{arch}-*.done"):  # another key's, unused for a day (80-100 MB each)
            if other != done and time.time() - other.stat().st_mtime > STALE_AFTER_S:
                shutil.rmtree(cache / other.name.removesuffix(".done"), ignore_errors=True)
                other.unlink(missing_ok=True)
    return folder


def build_tiny_vlm(arch: str, folder: Path) -> Path:
    """A tiny random-weight vision-language model of ``arch`` (one of :data:`ARCHITECTURES`) saved
    in ``folder`` with its processor; returns ``folder``. Seeded: the same weights every time."""
    if arch not in BUILDERS:
        raise ValueError(f"no tiny builder for {arch!r}; known: {', '.join(BUILDERS)}")
    _PROCESSORS.pop(str(folder), None)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    BUILDERS[arch](folder)
    tiny_processor(folder)  # the folder loads (Qwen2-VL's without a video processor)
    return folder
