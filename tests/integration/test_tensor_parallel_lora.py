"""LoRA adapters at ``--tensor-parallel-size 2`` against one rank (issue 45): the session's tiny
llama in float32 with two adapters from --lora-modules (two slots), three requests in one batch (one
per adapter and one of the base model) decode identical greedy tokens, their prompt logprobs within
1e-4; an adapter loaded at run time through the worker's load call (its slot refilled while the
others run) is served alike on both ranks; unloaded, it is NOT_FOUND, and loaded again, served."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.grpc_reads import ids_and_prompt_logprobs
from tests.lora_adapters import build_adapter
from tests.processes import WorkerProcess, side_by_side

pytestmark = pytest.mark.integration

FLAGS = ["--quantization", "none", "--dtype", "float32", "--enable-lora", "--max-loras", "2"]
FLAGS += ["--max-lora-rank", "8"]
PROMPTS = (
    [5, 17, 300, 41, 9, 77, 123, 88, 1000],
    [64, 2, 33, 900, 12, 450],
    [7, 7, 81, 3000, 19, 4, 250, 66],
)
STEPS = 16
STEPS_RUN = "sluice_worker_steps_total"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-lora-adapters")
    return {
        "alpha": build_adapter(tiny_model_dir, root / "alpha", seed=21),
        "beta": build_adapter(
            tiny_model_dir, root / "beta", seed=22, rank=4, targets=("q_proj", "down_proj")
        ),
        "gamma": build_adapter(
            tiny_model_dir, root / "gamma", seed=23, targets=("o_proj", "v_proj", "up_proj")
        ),
    }


@pytest.fixture(scope="module")
def workers(
    model_cache: Path,
    tiny_model_dir: Path,
    adapters: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """Two ranks and one rank of the tiny llama serving alpha and beta, loading side by side."""
    logs = tmp_path_factory.mktemp("tp-lora")
    modules = ["--lora-modules", f"alpha={adapters['alpha']} beta={adapters['beta']}"]
    started = [
        WorkerProcess(cache_dir=model_cache, log_dir=logs, model=str(tiny_model_dir), extra=extra)
        for extra in ([*FLAGS, *modules, "-tp", "2"], [*FLAGS, *modules])
    ]
    with side_by_side(started):
        yield started[0], started[1]


def generate(worker: WorkerProcess, model: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """A greedy request's :data:`STEPS` token ids and its prompt's logprobs, under ``model``."""
    request = pb.GenerateRequest(
        model=model,
        prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=prompt)),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, prompt_logprobs=0),
        return_token_ids=True,
    )
    return ids_and_prompt_logprobs(worker.address, request)


def together(worker: WorkerProcess, models: list[str]) -> list[tuple[list[int], list[float]]]:
    """One request per model (prompt i for the i-th), sent at once: they share the worker's steps."""
    with ThreadPoolExecutor(len(models)) as pool:
        return list(pool.map(lambda job: generate(worker, job[1], PROMPTS[job[0]]), enumerate(models)))


def same(
    sharded: list[tuple[list[int], list[float]]],
    expected: list[tuple[list[int], list[float]]],
    models: list[str],
) -> None:
    for (ids, scored), (want_ids, want_scored), model in zip(sharded, expected, models, strict=True):
        assert len(ids) == STEPS and ids == want_ids, model
        assert len(scored) > 4 and scored == pytest.approx(want_scored, abs=1e-4), model
        gap = max(abs(got - want) for got, want in zip(scored, want_scored, strict=True))
        print(f"{model or 'base'}: prompt logprobs within {gap:.1e} of one rank's")


def lora_call(worker: WorkerProcess, method: str, request: object) -> None:
    with grpc.insecure_channel(worker.address) as channel:
        getattr(pb_grpc.WorkerStub(channel), method)(request, timeout=60)


def test_two_adapters_and_the_base_in_one_batch_decode_the_tokens_of_one_rank(
    workers: tuple[WorkerProcess, WorkerProcess],
) -> None:
    two, one = workers
    models = ["alpha", "beta", ""]  # "": the base model
    before = two.metrics()[STEPS_RUN]
    sharded, expected = together(two, models), together(one, models)
    steps = two.metrics()[STEPS_RUN] - before
    print(f"two ranks: the three requests took {steps:.0f} steps")
    assert steps < 2 * STEPS  # they shared steps (one at a time: 3 x 16)
    same(sharded, expected, models)
    assert len({tuple(ids) for ids, _ in expected}) == 3  # the adapters move the tokens apart
    assert "tensor-parallel rank 1 of 2 joined (gloo)" in two.log_tail(400)


def test_an_adapter_loaded_at_run_time_is_served_on_every_rank_and_unloads(
    workers: tuple[WorkerProcess, WorkerProcess], adapters: dict[str, Path]
) -> None:
    two, one = workers
    load = pb.LoadLoraAdapterRequest(lora_name="gamma", lora_path=str(adapters["gamma"]))
    for worker in workers:
        lora_call(worker, "LoadLoraAdapter", load)
    models = ["gamma", "alpha", "gamma"]  # gamma takes beta's slot
    expected = together(one, models)
    same(together(two, models), expected, models)
    assert expected[0][0] != generate(one, "alpha", PROMPTS[0])[0]  # gamma's tokens are its own
    lora_call(two, "UnloadLoraAdapter", pb.UnloadLoraAdapterRequest(lora_name="gamma"))
    with pytest.raises(grpc.RpcError) as missing:
        generate(two, "gamma", PROMPTS[0])
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    lora_call(two, "LoadLoraAdapter", load)  # a new load: a new uid, copied into a slot again
    models = ["gamma", "beta"]
    same(together(two, models), together(one, models), models)
