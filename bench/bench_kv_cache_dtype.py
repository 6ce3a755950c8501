"""What an 8-bit KV cache (``--kv-cache-dtype int8|fp8``) costs in accuracy and gains in capacity.

Usage::

    python bench/bench_kv_cache_dtype.py                  # default model, float32, and tiny families
    python bench/bench_kv_cache_dtype.py --caches int8 --families llama,gemma4_text

Everything runs through the worker's paged runner (``ModelRunner.execute``), so each token's
logits come from attending the keys and values as the pool holds them:

- **logprob difference**: a fixed text (:data:`TEXT`) teacher-forced, its first 16 tokens as one
  prompt, then one decode row per token; per position the log-probability of the text's next
  token, against the same run with the float cache (mean and largest absolute difference);
- **greedy agreement**: each chat prompt continued greedily for ``--tokens`` tokens by both
  caches (all prompts as one decode batch): the share of positions holding the same token;
- **capacity**: the pool's tokens from the same ``--kv-cache-bytes``, against the float cache
  (float32 and bfloat16 models).

The tiny families (tests/tiny_families.py: random weights, sharp attention) get the logprob
difference on a token sequence of their small vocabulary.

``--key-smoothing none,calibration,weights`` measures, beside today's scheme (``none``), one key
scale per token and head after a static per-channel smoothing (bench/kv_key_smoothing.py; the
tiny families: ``calibration`` only).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import kv_key_smoothing as smoothing
from bench.bench_quant_quality import PROMPTS  # the same prompts as the weight-quantization bench
from worker.attention.kv_pool import KVShape, kv_shape
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work

BLOCK = 16
PROMPT_TOKENS = 16
TEXT = (
    "The river rises in the hills above the town and runs for forty miles before it reaches the sea. "
    "In the spring, when the snow melts, it floods the low fields along its banks, and the farmers move "
    "their animals to higher ground. For the rest of the year it is a quiet stream, shallow enough in "
    "places to cross on foot. A stone bridge, built more than two hundred years ago, carries the main "
    "road over it at the centre of the town. Children fish from the bridge in the summer evenings."
)


def runner(loaded: Any, cache: str, blocks: int = 256) -> ModelRunner:
    return ModelRunner(loaded, num_blocks=blocks, block_size=BLOCK, kv_cache_dtype=cache, max_sequences=16)


@torch.inference_mode()
def forced_logprobs(model: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Log-probability of each of ``ids[PROMPT_TOKENS:]`` given the tokens before it, through the pool."""
    table = list(range(-(-len(ids) // BLOCK)))
    rows = [model.execute([Work(ids[:PROMPT_TOKENS], 0, table, True)])[0]]
    for position in range(PROMPT_TOKENS, len(ids) - 1):
        rows.append(model.execute([Work([ids[position]], position, table, True)])[0])
    logprobs = torch.log_softmax(torch.stack(rows), dim=-1)
    return logprobs.gather(1, torch.tensor(ids[PROMPT_TOKENS:])[:, None])[:, 0]


@torch.inference_mode()
def greedy(model: ModelRunner, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """``tokens`` greedy tokens after each prompt, the prompts decoded as one batch."""
    width = -(-(max(map(len, prompts)) + tokens) // BLOCK)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(len(prompts))]
    logits = model.execute([Work(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    out = [[int(t)] for t in logits.argmax(-1)]
    for step in range(1, tokens):
        work = [
            Work([o[-1]], len(p) + step - 1, t, True) for p, o, t in zip(prompts, out, tables, strict=True)
        ]
        for row, token in zip(out, model.execute(work).argmax(-1), strict=True):
            row.append(int(token))
    return out


def capacity(config: Any, cache: str) -> str:
    """Tokens per byte of the 8-bit cache against the float cache, in float32 and bfloat16."""
    ratios = []
    for dtype in (torch.float32, torch.bfloat16):
        quantized: KVShape = kv_shape(config, dtype, cache)
        plain = kv_shape(config, dtype).bytes_per_token
        ratios.append(f"{plain / quantized.bytes_per_token:.2f}x ({str(dtype)[6:]})")
    return ", ".join(ratios)


Vectors = list[torch.Tensor | None]


@contextmanager
def scheme(vectors: Vectors | None) -> Iterator[Callable[[ModelRunner], ModelRunner]]:
    """Today's key groups (``vectors`` None), or smoothed keys with one scale per head."""
    if vectors is None:
        yield lambda model: model
        return
    with smoothing.smoothed_keys(vectors) as attach:
        yield attach


def default_vectors(loaded: Any, reference: ModelRunner, kinds: list[str]) -> dict[str, Vectors | None]:
    """Per ``--key-smoothing`` kind, the default model's smoothing vectors (None: today's scheme)."""
    config = loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    out: dict[str, Vectors | None] = {"none": None}
    if "calibration" in kinds:
        ids = list(loaded.tokenizer(smoothing.CALIBRATION)["input_ids"])
        out["calibration"] = smoothing.calibrated(reference, ids, BLOCK)
    if "weights" in kinds:
        out["weights"] = smoothing.from_weights(loaded.model, config.num_key_value_heads, head_dim)
    return out


def default_model(caches: list[str], tokens: int, kinds: list[str]) -> None:
    from worker.model.loader import load_model

    loaded = load_model(None, device="cpu", dtype="float32", quantization="none")
    tokenizer = loaded.tokenizer
    text = list(tokenizer(TEXT)["input_ids"])
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    prompts = [list(tokenizer(chat, add_special_tokens=False)["input_ids"]) for chat in chats]
    reference = runner(loaded, "auto")
    want_lp, want_text = forced_logprobs(reference, text), greedy(reference, prompts, tokens)
    vectors = default_vectors(loaded, reference, kinds)
    del reference
    print(f"default model (float32): text of {len(text)} tokens, {len(prompts)} prompts x {tokens} tokens")
    for kind, cache in [(k, c) for k in kinds for c in caches]:
        with scheme(vectors[kind]) as attach:
            measure_default(
                attach(runner(loaded, cache)),
                f"{cache} ({kind})",
                (text, prompts, tokens),
                (want_lp, want_text),
            )


def measure_default(
    model: ModelRunner,
    label: str,
    inputs: tuple[list[int], list[list[int]], int],
    wanted: tuple[torch.Tensor, list[list[int]]],
) -> None:
    """One line of the default model's figures for ``model`` against the float cache's ``wanted``."""
    (text, prompts, tokens), (want_lp, want_text) = inputs, wanted
    diff = (forced_logprobs(model, text) - want_lp).abs()
    got_text = greedy(model, prompts, tokens)
    pairs = [
        (a, b) for got, want in zip(got_text, want_text, strict=True) for a, b in zip(got, want, strict=True)
    ]
    same = sum(a == b for a, b in pairs)
    print(
        f"  {label}: |logprob diff| mean {float(diff.mean()):.4f}, max {float(diff.max()):.4f}; "
        f"greedy agreement {same / (len(prompts) * tokens):.1%}; capacity "
        f"{capacity(model.model.config, model.kv_shape.cache)}",
        flush=True,
    )


def tiny_families(caches: list[str], families: list[str], kinds: list[str]) -> None:
    from tests.tiny_families import COMMON, tiny_config, tiny_model

    vocab = COMMON["vocab_size"]
    ids = [(5 + 7 * i + (i * i) % 11) % vocab for i in range(80)]
    calibration = [(3 + 5 * i + (i * i) % 7) % vocab for i in range(48)]  # not the scored sequence
    print(f"tiny families (random weights, float32): {len(ids)} tokens teacher-forced")
    for family in families:
        model = tiny_model(tiny_config(family))
        loaded = SimpleNamespace(
            model=model, device=torch.device("cpu"), dtype=torch.float32, context_length=256
        )
        reference = runner(loaded, "auto", 16)
        want = forced_logprobs(reference, ids)
        vectors = {"none": None, "calibration": smoothing.calibrated(reference, calibration, BLOCK)}
        cells = []
        for kind, cache in [(k, c) for k in kinds if k in vectors for c in caches]:
            with scheme(vectors[kind]) as attach:
                diff = (forced_logprobs(attach(runner(loaded, cache, 16)), ids) - want).abs()
            cells.append(f"{cache} ({kind}) mean {float(diff.mean()):.4f} max {float(diff.max()):.4f}")
        print(f"  {family}: " + "; ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--caches", default="int8,fp8")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--families", default="llama,qwen3,gemma2,gemma3_text,gemma4_text,gpt_oss,qwen3_5_text,nemotron_h"
    )
    parser.add_argument("--skip-default", action="store_true")
    parser.add_argument(
        "--key-smoothing",
        default="none",
        help="comma list of none, calibration, weights (bench/kv_key_smoothing.py)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    caches, kinds = args.caches.split(","), args.key_smoothing.split(",")
    if not args.skip_default:
        default_model(caches, args.tokens, kinds)
    if args.families:
        tiny_families(caches, args.families.split(","), kinds)


if __name__ == "__main__":
    main()
