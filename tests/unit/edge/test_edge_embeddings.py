"""The embeddings, rerank and score surfaces against fake gRPC workers: request validation, answer
shapes (float and base64 vectors, rerank order, ``top_n``, ``return_documents``, score pairing) and
routing by the workers' tasks (404 for an unknown model, 400 for a model no worker serves that way)."""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest

from sluice.status import ErrorDetails, build_status
from sluice.v1 import worker_pb2
from tests.unit.edge.edge_fakes import FakeWorker, run, running_edge, running_worker

EMBEDDER = "tiny-embedder"
CHAT = "SmolLM2-135M-Instruct"


@dataclass(eq=False)
class FakePoolingWorker(FakeWorker):
    """Serves ``EMBEDDER`` with task embed: each text's vector is [its length, 1, 0]; a pair's score
    is 1 / (1 + the length difference of its texts)."""

    models: list[str] = field(default_factory=lambda: [EMBEDDER])
    task: str = "embed"
    seen: list[Any] = field(default_factory=list)

    async def ListModels(
        self, request: worker_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ListModelsResponse:
        infos = [worker_pb2.ModelInfo(id=m, task=self.task) for m in self.models]
        return worker_pb2.ListModelsResponse(models=infos, worker_id="pooling-worker")

    async def Embed(
        self, request: worker_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.EmbedResponse:
        self.seen.append(request)
        if request.dimensions == 7:
            await context.abort_with_status(
                build_status(
                    ErrorDetails(
                        grpc.StatusCode.INVALID_ARGUMENT, "dimensions 7 is not served", "x", "dimensions"
                    )
                )
            )
        vectors = []
        for item in request.inputs:
            size = len(item.text) if item.HasField("text") else len(item.token_ids.ids)
            vectors.append(worker_pb2.EmbedVector(values=[float(size), 1.0, 0.0], prompt_tokens=size))
        return worker_pb2.EmbedResponse(
            embeddings=vectors, prompt_tokens=sum(v.prompt_tokens for v in vectors), model=EMBEDDER
        )

    async def Tokenize(
        self, request: worker_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.TokenizeResponse:
        self.seen.append(request)
        ids = [7] * len(request.prompt.text)
        return worker_pb2.TokenizeResponse(ids=ids, count=len(ids), max_model_len=512, model=EMBEDDER)

    async def Score(
        self, request: worker_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ScoreResponse:
        self.seen.append(request)
        scores = [1.0 / (1 + abs(len(p.text_1) - len(p.text_2))) for p in request.pairs]
        return worker_pb2.ScoreResponse(scores=scores, prompt_tokens=10 * len(scores), model=EMBEDDER)


def _with_edge(check: Any) -> None:
    async def main() -> None:
        pooling, chat = FakePoolingWorker(), FakeWorker()
        async with (
            running_worker(pooling) as first,
            running_worker(chat) as second,
            running_edge([first, second]) as base,
            httpx.AsyncClient(base_url=base) as client,
        ):
            await check(client, pooling)

    run(main(), timeout=60)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def test_embeddings_float_base64_and_token_ids() -> None:
    async def check(client: httpx.AsyncClient, worker: FakePoolingWorker) -> None:
        answer = await client.post("/v1/embeddings", json={"model": EMBEDDER, "input": ["ab", "abcd"]})
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-Sluice-Worker-ID"] == "pooling-worker"
        body = answer.json()
        assert body["object"] == "list" and body["model"] == EMBEDDER
        assert [d["embedding"] for d in body["data"]] == [[2.0, 1.0, 0.0], [4.0, 1.0, 0.0]]
        assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "embedding"
        assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
        encoded = await client.post(
            "/v1/embeddings", json={"model": EMBEDDER, "input": "abc", "encoding_format": "base64"}
        )
        raw = base64.b64decode(encoded.json()["data"][0]["embedding"])
        assert struct.unpack("<3f", raw) == (3.0, 1.0, 0.0)
        ids = await client.post("/v1/embeddings", json={"model": EMBEDDER, "input": [5, 6, 7, 8, 9]})
        assert ids.json()["data"][0]["embedding"][0] == 5.0
        lists = await client.post(
            "/v1/embeddings", json={"model": EMBEDDER, "input": [[1], [1, 2]], "dimensions": 3}
        )
        assert [d["embedding"][0] for d in lists.json()["data"]] == [1.0, 2.0]
        assert worker.seen[-1].dimensions == 3 and list(worker.seen[-1].inputs[1].token_ids.ids) == [1, 2]
        refused = await client.post("/v1/embeddings", json={"model": EMBEDDER, "input": "a", "dimensions": 7})
        assert _error(refused, 400)["param"] == "dimensions"

    _with_edge(check)


INVALID_EMBEDDINGS = [
    ({"input": "a"}, "model"),
    ({"model": EMBEDDER}, "input"),
    ({"model": EMBEDDER, "input": ""}, "input"),
    ({"model": EMBEDDER, "input": []}, "input"),
    ({"model": EMBEDDER, "input": ["a", ""]}, "input"),
    ({"model": EMBEDDER, "input": [[1], []]}, "input"),
    ({"model": EMBEDDER, "input": [1, "a"]}, "input"),
    ({"model": EMBEDDER, "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"model": EMBEDDER, "input": "a", "dimensions": 0}, "dimensions"),
]


def test_embeddings_validation_names_the_field() -> None:
    async def check(client: httpx.AsyncClient, worker: FakePoolingWorker) -> None:
        for body, param in INVALID_EMBEDDINGS:
            assert _error(await client.post("/v1/embeddings", json=body), 400)["param"] == param, body
        assert not worker.seen

    _with_edge(check)


def test_routing_by_task() -> None:
    async def check(client: httpx.AsyncClient, worker: FakePoolingWorker) -> None:
        unknown = _error(await client.post("/v1/embeddings", json={"model": "nope", "input": "a"}), 404)
        assert unknown["code"] == "model_not_found"
        chat = _error(await client.post("/v1/embeddings", json={"model": CHAT, "input": "a"}), 400)
        assert chat["param"] == "model" and "--task embed" in chat["message"] and CHAT in chat["message"]
        rerank = _error(
            await client.post("/v1/rerank", json={"model": CHAT, "query": "q", "documents": ["d"]}), 400
        )
        assert "--task embed or score" in rerank["message"]
        # Without a model, any worker that scores takes it.
        answer = await client.post("/v1/score", json={"text_1": "ab", "text_2": "ab"})
        assert answer.status_code == 200 and answer.json()["data"][0]["score"] == 1.0

    _with_edge(check)


def test_rerank_orders_cuts_and_returns_documents() -> None:
    async def check(client: httpx.AsyncClient, worker: FakePoolingWorker) -> None:
        documents = ["abcdefgh", "abcd", "abcdefghijkl", "abc"]
        # Jina's shape: plain strings, documents returned.
        jina = await client.post(
            "/v1/rerank", json={"model": EMBEDDER, "query": "abcd", "documents": documents, "top_n": 3}
        )
        body = jina.json()
        assert [r["index"] for r in body["results"]] == [1, 3, 0]
        assert [r["document"]["text"] for r in body["results"]] == ["abcd", "abc", "abcdefgh"]
        assert body["results"][0]["relevance_score"] == 1.0 and body["usage"]["total_tokens"] == 40
        assert body["model"] == EMBEDDER and body["id"].startswith("rerank-")
        assert [(p.text_1, p.text_2) for p in worker.seen[-1].pairs] == [("abcd", d) for d in documents]
        # Cohere's shape: objects in, no documents out, every result without top_n.
        cohere = await client.post(
            "/v2/rerank",
            json={
                "model": EMBEDDER,
                "query": "abcd",
                "documents": [{"text": d} for d in documents],
                "return_documents": False,
                "max_tokens_per_doc": 512,
            },
        )
        results = cohere.json()["results"]
        assert [r["index"] for r in results] == [1, 3, 0, 2] and all("document" not in r for r in results)
        plain = await client.post("/rerank", json={"query": "abcd", "documents": documents, "top_n": 0})
        assert len(plain.json()["results"]) == 4
        for body_, param in (
            ({"query": "q", "documents": []}, "documents"),
            ({"query": "", "documents": ["d"]}, "query"),
            ({"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
            ({"documents": ["d"]}, "query"),
        ):
            assert _error(await client.post("/v1/rerank", json=body_), 400)["param"] == param

    _with_edge(check)


def test_score_pairs_one_text_with_many_or_two_lists_in_order() -> None:
    async def check(client: httpx.AsyncClient, worker: FakePoolingWorker) -> None:
        one = await client.post(
            "/v1/score", json={"model": EMBEDDER, "text_1": "ab", "text_2": ["ab", "abcd"]}
        )
        body = one.json()
        assert body["object"] == "list" and [d["score"] for d in body["data"]] == pytest.approx([1.0, 1 / 3])
        assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "score"
        both = await client.post("/v1/score", json={"text_1": ["a", "abc"], "text_2": ["a", "a"]})
        assert [d["score"] for d in both.json()["data"]] == pytest.approx([1.0, 1 / 3])
        mismatch = await client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
        assert _error(mismatch, 400)["param"] == "text_2"
        assert (
            _error(await client.post("/v1/score", json={"text_1": "a", "text_2": [1]}), 400)["param"]
            == "text_2"
        )

    _with_edge(check)


def test_tokenize_goes_to_a_worker_of_the_model() -> None:
    """Tokenizing uses the model's own tokenizer: a fleet with an embedder beside a chat model sends
    each model's /tokenize to its worker, never by load alone."""

    async def check(client: httpx.AsyncClient, worker: FakePoolingWorker) -> None:
        for _ in range(6):
            answer = await client.post("/tokenize", json={"model": EMBEDDER, "prompt": "abc"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["tokens"] == [7, 7, 7]
        assert len(worker.seen) == 6
        listing = (await client.get("/v1/models")).json()["data"]
        assert {m["id"]: m.get("task") for m in listing}[EMBEDDER] == "embed"
        unknown = _error(await client.post("/tokenize", json={"model": "nope", "prompt": "a"}), 404)
        assert unknown["param"] == "model"

    _with_edge(check)
