"""The bar of issue 43: checkpoints of one tiny model made by the real tools (``make fixtures``:
tools/quant_fixtures.py) served by a real worker in their own form, against transformers' forward
of the same checkpoint (which dequantizes): 24 greedy tokens equal except after a logit near-tie,
prompt logprobs within 2e-2, the quantized layers' bytes against float16, options refused by name.
The formats added later (asymmetric W4A16, AWQ, GPTQ act-order, block FP8, a tiny gpt-oss's MXFP4
experts) are checked in process on the worker's own loader: their layers are new, the serving path
after load is the same."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.v1 import worker_pb2 as pb
from tests.grpc_reads import ids_and_prompt_logprobs
from tests.processes import WorkerProcess
from tests.quant_checkpoints import quant_checkpoint
from worker.model.loader import ModelLoadError, load_model
from worker.model.prequantized import quantized_bytes

# format -> the most the quantized layers may hold against their float16 size (the bar)
FORMATS = {"fp8_dynamic": 0.6, "w4a16": 0.35, "gptq": 0.35}
IN_PROCESS = {
    "w4a16_asym": 0.35,
    "awq": 0.35,
    "gptq_act_order": 0.35,
    "fp8_block": 0.6,
    "fp8_block_ct": 0.6,  # compressed-tensors' FP8-block scheme: its inputs rounded per 32 columns
    "mxfp4": 0.35,  # 4.25 bits a weight (0.27x) and the experts' float32 biases
}  # no worker each: see above
NEAR_TIE = 2e-3  # logits closer than this (twice the forwards' differences seen) may order either way


@pytest.fixture(scope="module", params=list(FORMATS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One worker per format, on that format's checkpoint with ``--quantization auto``."""
    folder = quant_checkpoint(request.param)
    log_dir = tmp_path_factory.mktemp(f"prequantized-{request.param}")
    extra = ["--quantization", "auto", "--device", "cpu"]
    with WorkerProcess(cache_dir=log_dir, log_dir=log_dir, model=str(folder), extra=extra) as worker:
        yield request.param, folder, worker


def generate(worker: WorkerProcess, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """A greedy request's token ids and its prompt's logprobs, over the worker's gRPC API."""
    request = pb.GenerateRequest(
        prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=prompt)),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, prompt_logprobs=0),
        return_token_ids=True,
    )
    return ids_and_prompt_logprobs(worker.address, request)


def check_against_reference(name: str, folder: Path, ids: list[int], scored: list[float]) -> None:
    """The bar: prompt logprobs within 2e-2, tokens equal up to the first near-tie of the reference."""
    expected = json.loads((folder / "reference.json").read_text())
    assert scored[-len(expected["prompt_logprobs"]) :] == pytest.approx(expected["prompt_logprobs"], abs=2e-2)
    # Equal up to the first step whose reference logits were a near-tie (after it the texts may part).
    ties = [i for i, margin in enumerate(expected["margins"]) if margin < NEAR_TIE] + [len(ids)]
    assert ids[: ties[0] + 1] == expected["tokens"][: ties[0] + 1], f"near-ties at {ties[:-1]}"
    print(f"{name}: first near-tie at step {ties[0]}, margins {min(expected['margins']):.4f} min")


def test_the_bar(served: Any) -> None:
    name, folder, worker = served
    expected = json.loads((folder / "reference.json").read_text())
    check_against_reference(name, folder, *generate(worker, expected["prompt"], len(expected["tokens"])))
    assert "quantized checkpoint: " in worker.log_tail(200)


@torch.no_grad()
def greedy_in_process(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy ids and the prompt's logprobs from the loaded model's own forward (one new row a step,
    on transformers' KV cache)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    logprobs = out.logits.float().log_softmax(-1)[0]
    scored = [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    ids: list[int] = []
    for _ in range(steps):
        ids.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([ids[-1:]]), cache=out.cache, use_cache=True)
    return ids, scored


@pytest.mark.parametrize("name", list(IN_PROCESS))
def test_the_bar_in_process(name: str) -> None:
    folder = quant_checkpoint(name)
    model = load_model(str(folder), device="cpu", quantization="auto").model.eval()
    held, float16 = quantized_bytes(model)
    print(f"{name}: the quantized layers hold {held} bytes, {held / float16:.3f}x float16")
    assert 0 < held <= IN_PROCESS[name] * float16
    # No float expert weights were built (MXFP4 experts stay packed; the other fixtures have none).
    assert not [n for n, _ in model.named_parameters() if ".experts." in n]
    expected = json.loads((folder / "reference.json").read_text())
    check_against_reference(
        name, folder, *greedy_in_process(model, expected["prompt"], len(expected["tokens"]))
    )


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_loaded_weights_stay_quantized(name: str) -> None:
    """In process, as the worker loads them: the quantized layers' bytes against their float16 size."""
    model = load_model(str(quant_checkpoint(name)), device="cpu", quantization="auto").model
    held, float16 = quantized_bytes(model)
    logging.getLogger(__name__).info("%s: %.3fx float16", name, held / float16)
    assert 0 < held <= FORMATS[name] * float16
    assert not any(type(m) is torch.nn.Linear for n, m in model.named_modules() if n != "lm_head")


@pytest.mark.parametrize(
    ("name", "change", "named"),
    [
        ("w4a16", {"symmetric": False, "num_bits": 8, "strategy": "channel"}, "weights.symmetric: false"),
        ("fp8_dynamic", {"strategy": "block"}, "strategy 'block'"),
        ("gptq", {"bits": 8}, "GPTQ bits 8"),
        ("awq", {"version": "gemv"}, "AWQ version 'gemv'"),
        ("fp8_block", {"activation_scheme": "static"}, "activation_scheme 'static'"),
        ("mxfp4", {"group_size": 64}, "mxfp4 option 'group_size'"),
    ],
)
def test_a_real_checkpoint_with_an_unsupported_option_is_refused(
    name: str, change: dict[str, Any], named: str, tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(quant_checkpoint(name), tmp_path / name))
    config = json.loads((folder / "config.json").read_text())
    quantization = config["quantization_config"]
    target = (
        quantization
        if name in ("gptq", "awq", "fp8_block", "mxfp4")
        else quantization["config_groups"]["group_0"]["weights"]
    )
    target.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=named.replace("(", r"\(")):
        load_model(str(folder), device="cpu", quantization="auto")


def test_fp8_block_inputs_are_rounded_per_group_as_the_checkpoint_says() -> None:
    """compressed-tensors' FP8-block scheme rounds each 32 columns of an input under their own scale:
    so do we, to transformers' figures (rounded per row or not at all, the prompt logprobs move
    by 0.007, inside the bar's 2e-2 but not this test's 1e-4)."""
    folder = quant_checkpoint("fp8_block_ct")
    model = load_model(str(folder), device="cpu", quantization="auto").model.eval()
    expected = json.loads((folder / "reference.json").read_text())
    _, scored = greedy_in_process(model, expected["prompt"], 1)
    assert scored == pytest.approx(expected["prompt_logprobs"], abs=1e-4)


@pytest.mark.parametrize("order", ["weight", "static"])
def test_act_order_without_a_permutation_is_served_as_plain_groups(order: str, tmp_path: Path) -> None:
    """compressed-tensors' ``actorder`` "weight" and "static" order only GPTQ's work over the columns:
    the W4A16 checkpoint with either says so and still meets the bar against its reference."""
    folder = Path(shutil.copytree(quant_checkpoint("w4a16"), tmp_path / "w4a16"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = order
    (folder / "config.json").write_text(json.dumps(config))
    model = load_model(str(folder), device="cpu", quantization="auto").model.eval()
    expected = json.loads((folder / "reference.json").read_text())
    check_against_reference(
        "w4a16", folder, *greedy_in_process(model, expected["prompt"], len(expected["tokens"]))
    )
