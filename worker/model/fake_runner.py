"""A model runner that runs no model: tokens from a fixed passage, for benchmarking the edge.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from worker.config import DEFAULT_CACHE_DIR
from worker.model.load_progress import LoadProgress
from worker.model.loader import (
    DEFAULT_MODEL_ID,
    LoadedModel,
    ModelLoadError,
    context_length,
    default_gguf_path,
    gguf_cache_folder,
)
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work
from worker.types import SampledLogprobs

log = logging.getLogger(__name__)

SOURCE_PREFIX = "fake-tokens:"
# The text fake streams cycle through: plain prose with a few non-ASCII
# characters, so the detokenizer's multi-byte path is exercised too, and
# nothing a parser reacts to (no <think>, no <tool_call>).
PASSAGE = (
    "The river ran quietly past the old mill, where a café served coffee to travellers "
    "on their way north. Each morning the baker opened the shutters, swept the steps, "
    "and set out bread for the first customers — fishermen, teachers, a naïve young "
    "clerk who always counted his change twice. Nobody hurried; the water kept its own "
    "time, and so did the town. "
)
# The notional KV pool of a fake worker, in tokens, unless --max-batch-tokens says otherwise.
DEFAULT_TOKENS = 1 << 20
# Large enough that softmax puts all the mass on the chosen token (e^-100 per other token).
_SPIKE = 100.0


def passage_token_ids(tokenizer: Any) -> list[int]:
    """The passage as token ids (no special tokens); what fake rows cycle through."""
    ids = [int(i) for i in tokenizer(PASSAGE, add_special_tokens=False)["input_ids"]]
    if not ids:
        raise ModelLoadError("fake tokens: the tokenizer turned the fake passage into no tokens")
    return ids


class FakeRunner(ModelRunner):
    """Produces logits without a model; see docs/worker.md.

    It subclasses :class:`ModelRunner` so the engine's type holds; it overrides
    every method that would touch a model, and holds no KV cache.
    """

    scores_prompts = False  # no model: the engine refuses prompt_logprobs up front
    pool_bytes = 0  # no cache is allocated

    def __init__(
        self, loaded: LoadedModel, *, num_blocks: int, block_size: int, step_ms: float = 0.0, vocab: int = 0
    ):
        """``vocab``: logits this wide (0: the tokenizer's); the passage is then remapped onto the
        ordinary (not special) tokens below it, so what streams is no longer the passage's text."""
        if step_ms < 0:
            raise ValueError(f"step_ms must not be negative, got {step_ms}")
        # ModelRunner.__init__ is not called on purpose: it would need a model.
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.num_blocks = num_blocks
        self.block_size = block_size
        tokenizer = loaded.text_tokenizer
        self.vocab_size = len(tokenizer)
        self._passage = passage_token_ids(tokenizer)
        if vocab:
            special = set(tokenizer.all_special_ids)
            ordinary = [token for token in range(min(vocab, self.vocab_size)) if token not in special]
            if not ordinary:
                raise ValueError(f"a fake vocabulary of {vocab} holds only special tokens")
            self.vocab_size = vocab
            self._passage = [ordinary[token % len(ordinary)] for token in self._passage]
        self._step_s = step_ms / 1000.0
        self._due = 0.0  # when the notional device finishes the steps queued so far

    def execute(self, work: Sequence[Work], fed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits picking each sampling item's next passage token, in ``work`` order; the step takes
        ``step_ms`` of a notional device after the steps queued before it (see :meth:`ready`)."""
        if not work:
            raise ValueError("execute needs at least one item")
        if self._step_s:
            self._due = max(time.monotonic(), self._due) + self._step_s
        passage = self._passage
        return self._logits([passage[item.generated % len(passage)] for item in work if item.sample])

    def ready(self) -> Callable[[], None]:
        """Waits until the notional device finished the steps queued so far, as a GPU's event would
        (the sleep releases the GIL, as waiting for a device does)."""
        due = self._due

        def wait() -> None:
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)

        return wait

    def score(self, prompt: Sequence[int], top_n: int, lora: object = None) -> list[SampledLogprobs]:
        raise NotImplementedError("a fake-tokens worker runs no model, so it cannot score a prompt")

    def _logits(self, tokens: list[int]) -> torch.Tensor:
        logits = torch.zeros((len(tokens), self.vocab_size), dtype=torch.float32)
        if tokens:
            logits[torch.arange(len(tokens)), torch.tensor(tokens)] = _SPIKE
        return logits


def load_fake_model(
    model: str | None, *, served_model_name: str | None = None, cache_dir: Path | None = None
) -> LoadedModel:
    """The tokenizer (and context length) of ``model`` as a :class:`LoadedModel` with no model.

    ``model`` is resolved as :func:`~worker.model.loader.load_model` resolves it
    (None = the default model), and the model id is the same, so callers that
    name the model work unchanged. ``source`` starts with :data:`SOURCE_PREFIX`.
    """
    started = time.monotonic()
    cache = cache_dir or DEFAULT_CACHE_DIR
    target, gguf_file, model_id = _tokenizer_source(model, cache)
    try:
        if gguf_file is not None:
            tokenizer = AutoTokenizer.from_pretrained(target, gguf_file=gguf_file)
            config: Any = AutoConfig.from_pretrained(target, gguf_file=gguf_file)
        else:
            tokenizer = AutoTokenizer.from_pretrained(target)
            config = _folder_config(Path(target))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"fake tokens: could not load the tokenizer of {model or model_id!r}: {exc}"
        ) from exc
    where = f"{target}/{gguf_file}" if gguf_file else target
    log.warning(
        "FAKE TOKENS: this worker runs no model; it streams a fixed passage through the normal "
        "serving path, with the tokenizer of %s (from %s, loaded in %.1fs). For benchmarks only.",
        model_id,
        where,
        time.monotonic() - started,
    )
    return LoadedModel(
        model=None,
        tokenizer=tokenizer,
        model_id=served_model_name or model_id,
        source=f"{SOURCE_PREFIX} no model; tokenizer of {where}",
        context_length=context_length(config, tokenizer),
        device=torch.device("cpu"),
        dtype=torch.float32,
        loaded_at=time.time(),
    )


def _tokenizer_source(model: str | None, cache: Path) -> tuple[str, str | None, str]:
    """(folder or hub id, GGUF file name or None, model id) to load the tokenizer from."""
    if model is None or model.endswith(".gguf"):
        gguf = default_gguf_path() if model is None else Path(model).expanduser()
        if not gguf.is_file():
            raise ModelLoadError(f"--model {model}: no such GGUF file")
        model_id = DEFAULT_MODEL_ID if model is None else gguf.stem
        converted = gguf_cache_folder(gguf, cache)
        if (converted / "config.json").is_file():
            return str(converted), None, model_id  # already converted: fast
        return str(gguf.parent), gguf.name, model_id
    folder = Path(model).expanduser()
    if folder.is_dir():
        return str(folder), None, folder.resolve().name
    return model, None, model


def _folder_config(folder: Path) -> Any:
    """The model config as an object with attributes (only ``max_position_embeddings`` is read);
    an empty one for a hub id or a folder without config.json (the context length then falls back)."""
    path = folder / "config.json"
    if not path.is_file():
        return SimpleNamespace()
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"fake tokens: cannot read {path}: {exc}") from exc

    limit = values.get("max_position_embeddings", 0) if isinstance(values, dict) else 0
    return SimpleNamespace(max_position_embeddings=limit)


FAKE_LOAD_STEPS = 20


def fake_slow_load(seconds: float, progress: LoadProgress) -> None:
    """Spends ``seconds`` (``--fake-load-seconds``) "loading", raising ``progress`` evenly to 0.95,
    so that what callers see during a slow model load can be tested without a large model."""
    if seconds <= 0:
        return
    log.warning("FAKE TOKENS: the model load takes %g s (--fake-load-seconds)", seconds)
    for step in range(1, FAKE_LOAD_STEPS + 1):
        time.sleep(seconds / FAKE_LOAD_STEPS)
        progress.advance(0.95 * step / FAKE_LOAD_STEPS)
