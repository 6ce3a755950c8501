"""LoRA adapters on real workers behind one real edge (the bar of issue 44): two adapters from
--lora-modules and a third loaded at run time through the edge; each adapter's 16 greedy tokens and
its prompt's logprobs equal peft's merged model; twelve concurrent requests (three per adapter and
three of the base model) equal their sequential texts; an unknown or unloaded adapter is a 404
``model_not_found``; /v1/models lists the adapters under their base model; refusals name the
problem; a request in flight finishes after its adapter is unloaded; vLLM's lora gauge; routing by
adapter across two workers (one adapter on worker A only)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import grpc
import httpx
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.grpc_reads import ids_and_prompt_logprobs
from tests.lora_adapters import build_adapter, greedy_tokens, merged_model, prompt_logprobs
from tests.processes import EdgeProcess, WorkerProcess, side_by_side

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 300, 41, 9, 77, 123, 88, 1000]
STEPS = 16


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-adapters")
    folders = {
        "alpha": build_adapter(tiny_model_dir, root / "alpha", seed=11),
        "beta": build_adapter(tiny_model_dir, root / "beta", seed=12, rank=4, targets=("q_proj", "v_proj")),
        "gamma": build_adapter(
            tiny_model_dir, root / "gamma", seed=13, targets=("o_proj", "up_proj", "down_proj")
        ),
    }
    # Above --max-lora-rank 8: alpha's folder, its config saying rank 16 (refused before its weights' shapes).
    folders["wide"] = Path(shutil.copytree(folders["alpha"], root / "wide"))
    config = json.loads((folders["wide"] / "adapter_config.json").read_text())
    (folders["wide"] / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    return folders


SOLO = "solo"  # an adapter of worker A's --lora-modules only (the routing test unloads it)


@pytest.fixture(scope="module")
def workers(model_cache, tiny_model_dir, adapters, tmp_path_factory):
    """Worker A (alpha, beta and solo from --lora-modules) and worker B (--enable-lora, none)."""
    flags = ["--quantization", "none", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]
    modules = f"alpha={adapters['alpha']} beta={adapters['beta']} {SOLO}={adapters['gamma']}"
    extras = {
        "A": [*flags, "--lora-modules", modules, "--metrics-names", "both"],
        "B": flags,
    }
    log_dir = tmp_path_factory.mktemp("lora")
    for name in extras:
        (log_dir / name).mkdir()
    started = [
        WorkerProcess(
            cache_dir=model_cache,
            log_dir=log_dir / name,
            model=str(tiny_model_dir),
            extra=[*extra, "--worker-id", name],
        )
        for name, extra in extras.items()
    ]
    with side_by_side(started):
        yield started[0], started[1]


@pytest.fixture(scope="module")
def served(workers, tmp_path_factory):
    """Worker A and the edge (--allow-runtime-lora) over both workers."""
    log_dir = tmp_path_factory.mktemp("lora-edge")
    extra = ["--allow-runtime-lora"]
    with EdgeProcess([w.address for w in workers], log_dir=log_dir, extra=extra) as edge:
        yield workers[0], edge


def generate(worker: WorkerProcess, model: str, max_tokens: int = STEPS) -> tuple[list[int], list[float]]:
    """A greedy request's token ids and its prompt's logprobs, over the worker's gRPC API."""
    request = pb.GenerateRequest(
        model=model,
        prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=PROMPT)),
        sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0
        ),
        return_token_ids=True,
    )
    return ids_and_prompt_logprobs(worker.address, request)


def completion(client: httpx.Client, base: str, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    return client.post(f"{base}/v1/completions", json=body, timeout=60)


def test_the_bar(served, tiny_model_dir, adapters):
    worker, edge = served
    base = edge.base_url
    with httpx.Client() as client:
        listed = client.get(f"{base}/v1/models").json()["data"]
        model_id = next(m["id"] for m in listed if "parent" not in m)
        assert {m["id"]: m.get("parent") for m in listed if "parent" in m and m["id"] != SOLO} == {
            "alpha": model_id,
            "beta": model_id,
        }
        # A third adapter loaded at run time through the edge.
        load = {"lora_name": "gamma", "lora_path": str(adapters["gamma"])}
        assert client.post(f"{base}/v1/load_lora_adapter", json=load).status_code == 200
        listed = client.get(f"{base}/v1/models").json()["data"]
        adapters_listed = {m["id"] for m in listed if m.get("parent") == model_id}
        assert adapters_listed - {SOLO} == {"alpha", "beta", "gamma"}
    # Each adapter's 16 greedy tokens and prompt logprobs against peft's merged model.
    for name in ("alpha", "beta", "gamma", None):
        reference = merged_model(tiny_model_dir, None if name is None else adapters[name])
        ids, scored = generate(worker, name or model_id)
        assert ids == greedy_tokens(reference, PROMPT, STEPS), name
        assert scored == pytest.approx(prompt_logprobs(reference, PROMPT), abs=1e-3), name
    assert "vllm:lora_requests_info" in worker.metrics()
    # Twelve requests at once (three per adapter, three of the base model) equal their sequential texts.
    jobs = [(model, PROMPT[: 4 + i]) for model in ("alpha", "beta", "gamma", model_id) for i in range(3)]
    with httpx.Client() as client:
        sequential = [
            completion(client, base, model, prompt).json()["choices"][0]["text"] for model, prompt in jobs
        ]

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            bodies = [
                {"model": m, "prompt": p, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
                for m, p in jobs
            ]
            answers = await asyncio.gather(*(client.post(f"{base}/v1/completions", json=b) for b in bodies))
        return [answer.json()["choices"][0]["text"] for answer in answers]

    assert asyncio.run(together()) == sequential
    assert len(set(sequential[::3])) == 4  # the adapters and the base model answer apart


def test_refusals_unload_in_flight_and_unknown_adapters(served, adapters, tmp_path):
    worker, edge = served
    base = edge.base_url
    with httpx.Client(timeout=60) as client:
        for path, message in (
            (adapters["wide"], "rank 16, above --max-lora-rank 8"),
            (tmp_path / "missing", "does not exist or is not a folder"),
        ):
            refused = client.post(
                f"{base}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)}
            )
            assert refused.status_code == 400 and message in refused.json()["error"]["message"]
        load = {"lora_name": "delta", "lora_path": str(adapters["gamma"])}
        assert client.post(f"{base}/v1/load_lora_adapter", json=load).status_code == 200
        alone = generate(worker, "delta", max_tokens=160)[0]
        # A request in flight when its adapter is unloaded finishes with it.
        request = pb.GenerateRequest(
            model="delta",
            prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=PROMPT)),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True),
            return_token_ids=True,
        )
        with grpc.insecure_channel(worker.address) as channel:
            stream = pb_grpc.WorkerStub(channel).Generate(request, timeout=60)
            events = [next(stream)]  # started: the request holds its adapter
            assert events[0].WhichOneof("event") == "started"
            assert (
                client.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "delta"}).status_code == 200
            )
            events += list(stream)
        assert [t for e in events if e.WhichOneof("event") == "content" for t in e.content.token_ids] == alone
        for name in ("delta", "nope"):
            missing = completion(client, base, name, PROMPT)
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found", name
        gone = client.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "delta"})
        assert gone.status_code == 404


def test_requests_for_an_adapter_go_to_the_worker_that_has_it(served):
    """solo is on worker A only: its requests all go there, the base model's go to both workers,
    and once solo is unloaded through the edge it is a 404 ``model_not_found``."""
    _, edge = served
    base = edge.base_url

    def answered_by(client: httpx.Client, model: str, prompt: list[int]) -> str:
        reply = completion(client, base, model, prompt)
        assert reply.status_code == 200, reply.text
        return reply.headers["x-sluice-worker-id"]

    with httpx.Client(timeout=60) as client:
        listed = client.get(f"{base}/v1/models").json()["data"]
        model_id = next(m["id"] for m in listed if "parent" not in m)
        assert any(m["id"] == SOLO and m["parent"] == model_id for m in listed)
        assert {answered_by(client, SOLO, PROMPT[: 3 + i]) for i in range(4)} == {"A"}
        assert {answered_by(client, model_id, PROMPT[: 3 + i]) for i in range(4)} == {"A", "B"}
        unload = client.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": SOLO})
        assert unload.status_code == 200, unload.text
        gone = completion(client, base, SOLO, PROMPT)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert all(m["id"] != SOLO for m in client.get(f"{base}/v1/models").json()["data"])
