"""A hybrid model (Qwen3.5's Gated DeltaNet mix) on Sluice's runner against transformers' own cache.

Usage::

    python bench/bench_hybrid.py                       # a random 8-layer Qwen3.5-text model on the CPU
    python bench/bench_hybrid.py --prompt 1024 --batch 1,8 --threads 2

Builds a random-weight Qwen3.5 text model (three Gated DeltaNet layers per full-attention layer,
as the released models) and times, for the same weights in float32:

- prefill: one ``--prompt``-token prompt, Sluice's runner (one chunk over the paged KV pool and
  the state pool) against transformers' forward with its ``DynamicCache``;
- decode: ``--decode`` steps of B sequences at once for each B in ``--batch``, Sluice's decode
  rows (one step for all B, their states gathered from the slots) against transformers' batched
  forward of one token with its cache.

Prints milliseconds per prompt token and per decoded token (per sequence), and Sluice / transformers
ratios (below 1: Sluice is faster). Each figure is the median of ``--rounds`` runs. Compare figures
only within one run: machines differ between sessions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.model.runner import ModelRunner  # noqa: E402
from worker.model.step_inputs import Work  # noqa: E402

BLOCK = 16


def build_model(layers: int, hidden: int, device: str = "cpu", dtype: str = "float32") -> Any:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    config = Qwen3_5TextConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=kinds,
        linear_num_key_heads=hidden // 128,
        linear_num_value_heads=hidden // 64,
        linear_key_head_dim=128,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).to(device).eval()


def sluice_times(model: Any, prompt: int, decode: int, batch: int) -> tuple[float, float]:
    """Seconds for one prompt's prefill, and for ``decode`` steps of ``batch`` sequences."""
    blocks_each = -(-(prompt + decode) // BLOCK)
    loaded = SimpleNamespace(model=model, device=model.device, dtype=model.dtype, context_length=8192)
    runner = ModelRunner(loaded, num_blocks=batch * blocks_each, block_size=BLOCK, max_sequences=batch)
    ids = [(7 * i + 3) % 4096 for i in range(prompt)]
    tables = [list(range(s * blocks_each, (s + 1) * blocks_each)) for s in range(batch)]
    start = now(model)
    runner.execute([Work(ids, 0, tables[0], True, state_slot=0)])
    prefill = now(model) - start
    for s in range(1, batch):
        runner.execute([Work(ids, 0, tables[s], True, state_slot=s)])
    start = now(model)
    for step in range(decode):
        rows = [Work([step % 4096], prompt + step, tables[s], True, state_slot=s) for s in range(batch)]
        runner.execute(rows)
    return prefill, now(model) - start


def now(model: Any) -> float:
    """The time once the device has finished what was queued (a GPU runs behind the host)."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter()


@torch.inference_mode()
def transformers_times(model: Any, prompt: int, decode: int, batch: int) -> tuple[float, float]:
    """The same with transformers' forward and its ``DynamicCache``."""
    from transformers import DynamicCache

    ids = torch.tensor([[(7 * i + 3) % 4096 for i in range(prompt)]] * batch, device=model.device)
    cache = DynamicCache(config=model.config)
    start = now(model)
    model(input_ids=ids, cache=cache, use_cache=True)
    prefill = (now(model) - start) / batch
    start = now(model)
    for step in range(decode):
        token = torch.full((batch, 1), step % 4096, device=model.device)
        model(input_ids=token, cache=cache, use_cache=True)
    return prefill, now(model) - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--batch", default="1,8", help="comma-separated sequences decoded at once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (gpu-check)")
    parser.add_argument("--dtype", default="float32", help="float32, or bfloat16 on a GPU")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.layers, args.hidden, args.device, args.dtype)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"Qwen3.5-text, {args.layers} layers (3 Gated DeltaNet : 1 attention), hidden {args.hidden}, "
        f"{params:.1f}M parameters, {args.dtype} on {args.device}, {torch.get_num_threads()} threads"
    )
    print(f"{'batch':>5} {'prefill ms/token':>26} {'decode ms/token/sequence':>30}")
    print(f"{'':>5} {'sluice':>8} {'transf.':>8} {'ratio':>8} {'sluice':>9} {'transf.':>9} {'ratio':>8}")
    for batch in (int(b) for b in args.batch.split(",")):
        ours = [sluice_times(model, args.prompt, args.decode, batch) for _ in range(args.rounds)]
        theirs = [transformers_times(model, args.prompt, args.decode, batch) for _ in range(args.rounds)]
        prefill = [statistics.median(t[0] for t in runs) * 1000 / args.prompt for runs in (ours, theirs)]
        step = [
            statistics.median(t[1] for t in runs) * 1000 / (args.decode * batch) for runs in (ours, theirs)
        ]
        print(
            f"{batch:>5} {prefill[0]:>8.3f} {prefill[1]:>8.3f} {prefill[0] / prefill[1]:>8.2f} "
            f"{step[0]:>9.3f} {step[1]:>9.3f} {step[0] / step[1]:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
