"""Quality of the quantized default model against float32, on fixed prompts and a fixed text.

Usage::

    python bench/bench_quant_quality.py                     # int8 and int4 against none
    python bench/bench_quant_quality.py --schemes int4 --tokens 32

For each scheme, the default model is loaded as the worker loads it
(``load_model(None, quantization=S)``; ``none`` is the float32 model dequantized
from the GGUF file, the reference) and compared on:

- **greedy agreement**: each of the chat prompts below is continued greedily
  for ``--tokens`` (32) tokens by both models; reported are the share of
  positions where the two continuations hold the same token and the mean length
  of the common prefix (the tokens before the first difference);
- **logprob difference**: the float32 model's greedy continuation is scored by
  both models (teacher forcing); the mean absolute difference of the
  log-probability of the chosen token, over all prompts and positions;
- **perplexity** of each model on the fixed text below (one forward over it).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.model.loader import LoadedModel, load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a bicycle works in two sentences.",
    "List three fruits that are red.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]

TEXT = (
    "The river rises in the hills above the town and runs for forty miles before it reaches the sea. "
    "In the spring, when the snow melts, it floods the low fields along its banks, and the farmers move "
    "their animals to higher ground. For the rest of the year it is a quiet stream, shallow enough in "
    "places to cross on foot. A stone bridge, built more than two hundred years ago, carries the main "
    "road over it at the centre of the town. Children fish from the bridge in the summer evenings, and "
    "the old mill beside it has been turned into a small museum that explains how grain was once ground "
    "by the power of the water. Visitors often ask why the town grew up at this point on the river. The "
    "answer is simple: it was the last place where the water was shallow enough to ford before the "
    "valley widened and the river became too deep and too fast to cross without a boat."
)


def prompt_ids(loaded: LoadedModel, prompt: str) -> list[int]:
    tokenizer = loaded.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.inference_mode()
def greedy(loaded: LoadedModel, ids: list[int], tokens: int) -> list[int]:
    """``tokens`` greedy tokens (no early stop at end-of-sequence: the comparison is position by position)."""
    model, out = loaded.model, list(ids)
    result = model(input_ids=torch.tensor([out]), use_cache=True)
    cache = result.past_key_values
    for _ in range(tokens):
        token = int(result.logits[0, -1].argmax())
        out.append(token)
        result = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
    return out[len(ids) :]


@torch.inference_mode()
def chosen_logprobs(loaded: LoadedModel, ids: list[int], continuation: list[int]) -> torch.Tensor:
    """Log-probability of each continuation token given everything before it."""
    full = torch.tensor([ids + continuation])
    logits = loaded.model(input_ids=full).logits[0, len(ids) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(continuation)[:, None])[:, 0]


@torch.inference_mode()
def perplexity(loaded: LoadedModel, text: str) -> float:
    ids = torch.tensor([loaded.tokenizer(text)["input_ids"]])
    logits = loaded.model(input_ids=ids).logits[0, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(float(loss))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schemes", default="int8,int4")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--cache-dir", help="the worker's converted-model cache")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = Path(args.cache_dir) if args.cache_dir else None

    reference = load_model(None, device="cpu", dtype="float32", quantization="none", cache_dir=cache)
    inputs = [prompt_ids(reference, p) for p in PROMPTS]
    ref_greedy = [greedy(reference, ids, args.tokens) for ids in inputs]
    ref_logprobs = [
        chosen_logprobs(reference, ids, cont) for ids, cont in zip(inputs, ref_greedy, strict=True)
    ]
    print(f"{len(PROMPTS)} prompts, {args.tokens} greedy tokens each; text of {len(TEXT.split())} words")
    print(f"none : perplexity {perplexity(reference, TEXT):.3f} (the float32 reference)")
    for scheme in args.schemes.split(","):
        loaded = load_model(None, device="cpu", dtype="float32", quantization=scheme, cache_dir=cache)
        same = prefix = 0
        diffs = []
        for ids, ref_cont, ref_lp in zip(inputs, ref_greedy, ref_logprobs, strict=True):
            cont = greedy(loaded, ids, args.tokens)
            same += sum(a == b for a, b in zip(cont, ref_cont, strict=True))
            prefix += next(
                (i for i, (a, b) in enumerate(zip(cont, ref_cont, strict=True)) if a != b), args.tokens
            )
            diffs.append((chosen_logprobs(loaded, ids, ref_cont) - ref_lp).abs())
        total = len(PROMPTS) * args.tokens
        print(
            f"{scheme:5}: greedy agreement {same / total:.1%} of positions, common prefix "
            f"{prefix / len(PROMPTS):.1f} of {args.tokens} tokens; mean |logprob diff| of the chosen "
            f"tokens {float(torch.cat(diffs).mean()):.4f}; perplexity {perplexity(loaded, TEXT):.3f}",
            flush=True,
        )
        del loaded


if __name__ == "__main__":
    main()
