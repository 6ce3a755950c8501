"""The edge's LoRA adapters with fake workers: an adapter's request goes to the workers listing it,
loads and unloads reach every worker, and the routes are off without --allow-runtime-lora."""

from __future__ import annotations

from typing import Any, cast

import grpc
import httpx
import pytest

from edge.errors import InvalidRequestError, NotFoundError
from edge.workers.pool import WorkerPool
from sluice.client import WorkerClient
from sluice.v1 import worker_pb2
from tests.unit.edge.edge_fakes import FakeWorker, run, running_edge, running_worker
from tests.unit.edge.test_edge_worker_pool import FakeClient, failure, make_pool


class LoraClient(FakeClient):
    """A fake worker serving model "m" and the adapters in ``adapters``."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.adapters: set[str] = set()
        self.refuse: str | None = None

    async def list_models(self, *, timeout: float | None = None) -> worker_pb2.ListModelsResponse:  # noqa: ASYNC109
        models = [worker_pb2.ModelInfo(id="m")]
        models += [worker_pb2.ModelInfo(id=name, parent="m") for name in sorted(self.adapters)]
        return worker_pb2.ListModelsResponse(models=models, worker_id=f"id-{self.address}")

    async def lora_adapter(
        self,
        request: Any,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (WorkerClient's signature)
    ) -> worker_pb2.LoraAdapterResponse:
        if self.refuse is not None:
            raise failure(grpc.StatusCode.INVALID_ARGUMENT, message=self.refuse)
        if isinstance(request, worker_pb2.UnloadLoraAdapterRequest):
            if request.lora_name not in self.adapters:
                raise failure(grpc.StatusCode.NOT_FOUND, message="not loaded")
            self.adapters.discard(request.lora_name)
        else:
            self.adapters.add(request.lora_name)
        return worker_pb2.LoraAdapterResponse(lora_name=request.lora_name, worker_id=f"id-{self.address}")


class LoraFakes:
    def __init__(self) -> None:
        self.clients: dict[str, LoraClient] = {}

    def __call__(self, address: str) -> WorkerClient:
        self.clients[address] = LoraClient(address)
        return cast(WorkerClient, self.clients[address])


def pool_of(count: int) -> tuple[WorkerPool, LoraFakes]:
    fakes = LoraFakes()
    return make_pool([f"w{i}:{i + 1}" for i in range(count)], cast(Any, fakes)), fakes


def test_an_adapter_request_goes_to_the_workers_holding_it_first() -> None:
    async def body() -> None:
        pool, fakes = pool_of(3)
        fakes.clients["w2:3"].adapters.add("sql")
        await pool.list_models()
        for _ in range(4):  # whatever the rotation and the load
            placement = await pool.place(worker_pb2.GenerateRequest(model="sql"))
            assert placement.workers[0].address == "w2:3" and len(placement.workers) == 3
        pool._workers["w2:3"].outstanding = 5
        assert (await pool.place(worker_pb2.GenerateRequest(model="sql"))).workers[0].address == "w2:3"
        # The base model's requests (and unknown names) are placed by load alone.
        firsts = {
            (await pool.place(worker_pb2.GenerateRequest(model="m"))).workers[0].address for _ in range(4)
        }
        assert firsts == {"w0:1", "w1:2"}
        await pool.close()

    run(body())


def test_load_and_unload_reach_every_worker_and_refresh_the_listing() -> None:
    async def body() -> None:
        pool, fakes = pool_of(2)
        load = worker_pb2.LoadLoraAdapterRequest(lora_name="sql", lora_path="/a")
        assert sorted(await pool.lora_adapter(load)) == ["id-w0:1", "id-w1:2"]
        assert all(w.serves("sql", ("generate",)) for w in pool._workers.values())
        fakes.clients["w0:1"].adapters.discard("sql")  # one worker lost it: the unload still succeeds
        unload = worker_pb2.UnloadLoraAdapterRequest(lora_name="sql")
        assert await pool.lora_adapter(unload) == ["id-w1:2"]
        with pytest.raises(NotFoundError):  # no worker has it
            await pool.lora_adapter(unload)
        fakes.clients["w1:2"].refuse = "rank 64 is above --max-lora-rank 16"
        with pytest.raises(InvalidRequestError, match="max-lora-rank"):
            await pool.lora_adapter(load)
        await pool.close()

    run(body())


class LoraWorker(FakeWorker):
    """A fake gRPC worker that takes LoRA loads and lists what it loaded under model "m"."""

    def __init__(self) -> None:
        super().__init__(models=["m"])
        self.loaded: list[str] = []

    async def LoadLoraAdapter(
        self, request: Any, context: Any
    ) -> worker_pb2.LoraAdapterResponse:  # gRPC name
        self.loaded.append(request.lora_name)
        self.models.append(request.lora_name)
        return worker_pb2.LoraAdapterResponse(lora_name=request.lora_name, worker_id=self.worker_id)


def test_the_routes_are_off_by_default_and_behind_the_api_keys() -> None:
    body = {"lora_name": "sql", "lora_path": "/adapters/sql"}

    async def scenario() -> None:
        fake = LoraWorker()
        async with running_worker(fake) as address, httpx.AsyncClient() as client:
            async with running_edge([address]) as base:
                off = await client.post(f"{base}/v1/load_lora_adapter", json=body)
                assert off.status_code == 404 and "--allow-runtime-lora" in off.json()["error"]["message"]
            async with running_edge([address], allow_runtime_lora=True, api_keys=("sk-op",)) as base:
                assert (await client.post(f"{base}/v1/load_lora_adapter", json=body)).status_code == 401
                bad = await client.post(
                    f"{base}/v1/load_lora_adapter",
                    json={"lora_name": "x"},
                    headers={"Authorization": "Bearer sk-op"},
                )
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
                done = await client.post(
                    f"{base}/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer sk-op"}
                )
                assert done.status_code == 200 and done.json()["lora_name"] == "sql"
        assert fake.loaded == ["sql"]

    run(scenario())
