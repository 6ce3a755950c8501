"""Issue 45's MoE bar: a tiny random gpt-oss (attention sinks, biases, alternating windows, MoE) in
float32 served by a ``--tensor-parallel-size 2`` worker decodes the greedy tokens of transformers'
``generate`` and scores its prompt within 1e-4 of transformers' forward."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.v1 import worker_pb2 as pb
from tests.grpc_reads import ids_and_prompt_logprobs
from tests.lora_adapters import greedy_tokens, prompt_logprobs
from tests.processes import WorkerProcess
from tests.tiny_families import eager_reference, tiny_config, tiny_model

pytestmark = pytest.mark.integration

# Longer than the tiny model's window of 8, so the sliding layers drop tokens.
PROMPT = [5, 17, 300, 41, 9, 1200, 77, 3, 512, 64, 8, 2048, 31, 700, 12, 4000, 6, 90, 150, 44]
TOKENS = 16


def build_tiny_gpt_oss(folder: Path, tokenizer_dir: Path) -> Any:
    """Saves a tiny random gpt-oss with the default model's tokenizer into ``folder``; returns
    transformers' eager float32 model of the same weights."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(tiny_config("gpt_oss", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id))
    with torch.no_grad():  # transformers starts biases at zero: a bias summed twice would not show
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(torch.randn_like(parameter) * 0.2)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return eager_reference(model)


@pytest.fixture(scope="module")
def served(
    model_cache: Path, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, Any]]:
    """The two-rank worker of the tiny gpt-oss, and transformers' model of it."""
    folder = tmp_path_factory.mktemp("tiny-gpt-oss")
    reference = build_tiny_gpt_oss(folder, default_model_dir)
    extra = ["-tp", "2", "--quantization", "none", "--dtype", "float32", "--kv-cache-bytes", str(64 << 20)]
    logs = tmp_path_factory.mktemp("tp-moe-logs")
    with WorkerProcess(cache_dir=model_cache, log_dir=logs, model=str(folder), extra=extra) as worker:
        yield worker, reference


def test_two_ranks_of_a_tiny_gpt_oss_decode_like_transformers_generate(
    served: tuple[WorkerProcess, Any],
) -> None:
    worker, reference = served
    request = pb.GenerateRequest(
        prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=PROMPT)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, prompt_logprobs=0),
        return_token_ids=True,
    )
    ids, scored = ids_and_prompt_logprobs(worker.address, request)
    assert ids == greedy_tokens(reference, PROMPT, TOKENS)
    expected = prompt_logprobs(reference, PROMPT)
    assert len(expected) == len(PROMPT) - 1 and len(scored) >= len(expected)
    assert scored[-len(expected) :] == pytest.approx(expected, abs=1e-4)
    assert "tensor-parallel rank 1 of 2 joined (gloo)" in worker.log_tail(400)
