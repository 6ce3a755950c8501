"""Pooling models (``--task embed|score``): what a folder is read as, the pooling itself, the pooling
engine's batching, the service's checks, and a tiny random cross-encoder scored end to end in process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from sluice.v1 import worker_pb2 as pb
from worker.engine.pooling import PoolingEngine
from worker.errors import InvalidRequest, ModelNotFound, QueueFull, WrongTask
from worker.model.loader import LoadedModel, ModelLoadError, load_model
from worker.model.pooling import PoolingSpec, detect_task, finish_vectors, pool, read_spec
from worker.model.pooling_runner import PoolingInput, PoolingRunner
from worker.service.pooling import check_task, embed_response, prepare_embed, prepare_score, score_response


def test_pooling_modes_ignore_padding() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert torch.equal(pool(hidden, mask, "cls"), hidden[:, 0])
    assert torch.allclose(pool(hidden, mask, "mean")[1], hidden[1, :2].mean(0))
    assert torch.allclose(pool(hidden, mask, "mean")[0], hidden[0].mean(0))
    assert torch.equal(pool(hidden, mask, "max")[1], hidden[1, :2].amax(0))
    assert torch.equal(pool(hidden, mask, "last"), torch.stack([hidden[0, 3], hidden[1, 1]]))


def test_finish_vectors_cuts_then_normalises() -> None:
    rows = torch.tensor([[3.0, 4.0, 12.0]])
    assert torch.allclose(finish_vectors(rows, PoolingSpec("embed")), rows / 13)
    assert torch.allclose(finish_vectors(rows, PoolingSpec("embed"), 2), torch.tensor([[0.6, 0.8]]))
    assert torch.equal(finish_vectors(rows, PoolingSpec("embed", normalize=False)), rows)


def test_sentence_transformers_folder_is_read_from_its_modules(minilm_dir: Path) -> None:
    assert detect_task(minilm_dir) == "embed"
    spec = read_spec("embed", minilm_dir, None)
    assert spec == PoolingSpec("embed", "mean", True, 256, ())


def test_plain_models_pool_the_last_token_normalised(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert detect_task(tmp_path) == "generate"
    assert detect_task(None) == "generate"
    assert read_spec("embed", tmp_path, None) == PoolingSpec("embed", "last", True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    assert detect_task(tmp_path) == "score"


def test_unsupported_sentence_modules_are_refused(minilm_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "st"
    shutil.copytree(minilm_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(
        json.dumps(
            [
                *modules,
                {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
            ]
        )
    )
    with pytest.raises(ValueError, match="Dense"):
        read_spec("embed", folder, None)
    (folder / "modules.json").write_text(json.dumps(modules))
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match="exactly one"):
        read_spec("embed", folder, None)


# ------------------------------------------------------------------ the engine


class _RecordingRunner:
    """A pooling runner that returns each input's length and first id, and records its batches."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.gate = asyncio.Event()

    def forward(self, inputs: list[PoolingInput]) -> torch.Tensor:
        self.batches.append(len(inputs))
        return torch.tensor([[float(len(i.token_ids)), float(i.token_ids[0])] for i in inputs])


def _inputs(*lengths: int) -> list[PoolingInput]:
    return [PoolingInput(tuple(range(n, 2 * n))) for n in lengths]


def _engine(runner: _RecordingRunner, **limits: int) -> PoolingEngine:
    return PoolingEngine(runner, **limits)  # type: ignore[arg-type]


def test_engine_batches_queued_requests_and_splits_large_ones() -> None:
    async def main() -> None:
        runner = _RecordingRunner()
        engine = _engine(runner, max_rows=4, budget_tokens=1000)
        # Queued before the loop starts: the first step takes rows from both, in arrival order.
        first = engine.submit("a", _inputs(2, 3))
        second = engine.submit("b", _inputs(4, 5, 6, 7, 8))
        engine.start()
        try:
            rows_a, rows_b = await asyncio.wait_for(asyncio.gather(first, second), 30)
        finally:
            engine.stop()
        assert rows_a[:, 0].tolist() == [2, 3]
        assert rows_b[:, 0].tolist() == [4, 5, 6, 7, 8]
        assert runner.batches == [4, 3]
        assert engine.stats().counters.requests_finished == 2

    asyncio.run(main())


def test_engine_step_stays_within_the_token_budget() -> None:
    async def main() -> None:
        runner = _RecordingRunner()
        engine = _engine(runner, max_rows=8, budget_tokens=12)
        future = engine.submit("a", _inputs(3, 3, 3, 3, 20, 2))
        engine.start()
        try:
            rows = await asyncio.wait_for(future, 30)
        finally:
            engine.stop()
        assert rows[:, 0].tolist() == [3, 3, 3, 3, 20, 2]
        # 4 x 3 padded tokens fit 12; the 20-token input runs alone (over the budget on its own).
        assert runner.batches == [4, 1, 1]

    asyncio.run(main())


def test_engine_queue_bound_and_cancelled_requests() -> None:
    async def main() -> None:
        runner = _RecordingRunner()
        engine = _engine(runner, max_queue=2)
        dropped = engine.submit("a", _inputs(2))
        kept = engine.submit("b", _inputs(3))
        with pytest.raises(QueueFull):
            engine.submit("c", _inputs(4))
        dropped.cancel()
        engine.start()
        try:
            rows = await asyncio.wait_for(kept, 30)
        finally:
            engine.stop()
        assert rows[:, 0].tolist() == [3] and runner.batches == [1]
        assert engine.stats().counters.requests_cancelled == 1

    asyncio.run(main())


# -------------------------------------------------- a tiny random cross-encoder


@pytest.fixture(scope="module")
def cross_encoder(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny random BertForSequenceClassification (one label) with MiniLM's tokenizer, loaded
    as the worker loads it (``--task auto``)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("cross-encoder")
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        num_labels=1,
    )
    config.architectures = ["BertForSequenceClassification"]
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_model(str(folder), task="auto", device="cpu", cache_dir=folder)


def test_cross_encoder_scores_are_the_sigmoid_of_its_logit(cross_encoder: LoadedModel) -> None:
    assert cross_encoder.task == "score" and cross_encoder.context_length == 128
    pairs = [
        ("what is a cat?", "a small furry animal"),
        ("what is a cat?", "the stock market fell sharply today"),
    ]
    request = pb.ScoreRequest(pairs=[pb.ScorePair(text_1=a, text_2=b) for a, b in pairs])
    work = prepare_score(cross_encoder, request)
    assert all(item.token_type_ids is not None and 1 in item.token_type_ids for item in work.inputs)
    assert cross_encoder.pooling is not None
    runner = PoolingRunner(cross_encoder.model, cross_encoder.pooling, cross_encoder.device, 0)
    reply = score_response(cross_encoder, work, runner.forward(work.inputs), "w")
    tokenizer = cross_encoder.tokenizer
    with torch.inference_mode():
        expected = [
            torch.sigmoid(cross_encoder.model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0])
            for a, b in pairs
        ]
    assert reply.scores == pytest.approx([float(e) for e in expected], abs=1e-5)
    assert reply.prompt_tokens == sum(len(item.token_ids) for item in work.inputs)


def test_tasks_are_checked_and_requests_validated(cross_encoder: LoadedModel) -> None:
    check_task(cross_encoder, "Score", "")
    with pytest.raises(WrongTask, match=r"task 'score'.*--task embed"):
        check_task(cross_encoder, "Embed", "")
    with pytest.raises(WrongTask, match="--task generate"):
        check_task(cross_encoder, "Generate", "")
    with pytest.raises(ModelNotFound):
        check_task(cross_encoder, "Score", "another-model")
    with pytest.raises(InvalidRequest) as empty:
        prepare_score(cross_encoder, pb.ScoreRequest(pairs=[pb.ScorePair(text_1="q", text_2="")]))
    assert empty.value.param == "pairs[0]"
    with pytest.raises(InvalidRequest) as none:
        prepare_score(cross_encoder, pb.ScoreRequest())
    assert none.value.param == "pairs"
    with pytest.raises(InvalidRequest) as long:
        prepare_score(
            cross_encoder, pb.ScoreRequest(pairs=[pb.ScorePair(text_1="cat " * 100, text_2="dog " * 100)])
        )
    assert long.value.param == "pairs[0]" and "at most 128" in long.value.message


def test_pooling_tasks_refuse_quantized_weights(minilm_dir: Path) -> None:
    with pytest.raises(ModelLoadError) as refused:
        load_model(str(minilm_dir), task="embed", device="cpu", quantization="int8", cache_dir=minilm_dir)
    assert refused.value.param == "quantization"


def test_embed_requests_are_checked(minilm_dir: Path) -> None:
    loaded = load_model(str(minilm_dir), task="auto", device="cpu", cache_dir=minilm_dir, cpu_linear="torch")
    assert loaded.task == "embed" and loaded.context_length == 256

    def embed(*inputs: pb.EmbedInput, dimensions: int = 0) -> InvalidRequest:
        with pytest.raises(InvalidRequest) as refused:
            prepare_embed(loaded, pb.EmbedRequest(inputs=list(inputs), dimensions=dimensions))
        return refused.value

    text = pb.EmbedInput(text="hello")
    assert embed(text, dimensions=128).param == "dimensions"
    assert prepare_embed(loaded, pb.EmbedRequest(inputs=[text], dimensions=384)).dimensions == 0
    assert embed(text, pb.EmbedInput(text="")).param == "inputs[1]"
    assert embed(pb.EmbedInput(token_ids=pb.TokenIds(ids=[1, 10**6]))).param == "inputs[0]"
    assert embed(pb.EmbedInput(text="word " * 300)).param == "inputs[0]"
    assert embed(pb.EmbedInput()).param == "inputs[0]"
    assert embed().param == "inputs"
    work = prepare_embed(
        loaded, pb.EmbedRequest(inputs=[text, pb.EmbedInput(token_ids=pb.TokenIds(ids=[101, 7592, 102]))])
    )
    assert work.inputs[1].token_ids == (101, 7592, 102) and work.inputs[0].token_ids[0] == 101
    # A model that declares Matryoshka sizes serves them: cut, then normalised again.
    assert loaded.pooling is not None
    matryoshka = dataclasses.replace(
        loaded, pooling=dataclasses.replace(loaded.pooling, matryoshka_dimensions=(128, 64))
    )
    cut = prepare_embed(matryoshka, pb.EmbedRequest(inputs=[text], dimensions=128))
    rows = torch.randn(1, 384)
    reply = embed_response(matryoshka, cut, rows, "w")
    vector = torch.tensor(reply.embeddings[0].values)
    assert vector.shape == (128,) and torch.allclose(
        vector, torch.nn.functional.normalize(rows[0, :128], dim=0)
    )
    with pytest.raises(InvalidRequest, match="it gives 128, 64, 384"):
        prepare_embed(matryoshka, pb.EmbedRequest(inputs=[text], dimensions=100))


# ------------------------------------------------------------------ the drain


class _SlowPoolingService:
    """Embed waits until released; Score answers at once."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def Embed(self, request: pb.EmbedRequest, context: object) -> pb.EmbedResponse:
        self.entered.set()
        await asyncio.Event().wait()
        return pb.EmbedResponse()

    async def Score(self, request: pb.ScoreRequest, context: object) -> pb.ScoreResponse:
        return pb.ScoreResponse(scores=[0.5])


def test_drain_refuses_new_pooled_calls_and_cuts_running_ones() -> None:
    import grpc

    from sluice.client import WorkerCallError, WorkerClient
    from worker.service.drain import DrainingWorker
    from worker.service.wire_decoding import add_worker_service

    async def main() -> None:
        service = _SlowPoolingService()
        served = DrainingWorker(service)  # type: ignore[arg-type]
        server = grpc.aio.server()
        add_worker_service(served, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with WorkerClient(f"127.0.0.1:{port}") as client:
                assert list((await client.score(pb.ScoreRequest(), timeout=10)).scores) == [0.5]
                running = asyncio.ensure_future(client.embed(pb.EmbedRequest(), timeout=10))
                await asyncio.wait_for(service.entered.wait(), 10)
                assert served.in_flight == 1
                served.start_drain()
                with pytest.raises(WorkerCallError) as refused:
                    await client.score(pb.ScoreRequest(), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert not await served.wait_idle(0.1)
                assert served.cut() == 1
                with pytest.raises(WorkerCallError) as cut:
                    await running
                assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and "grace period" in cut.value.message
                assert await served.wait_idle(5)
        finally:
            await server.stop(None)

    asyncio.run(main())
